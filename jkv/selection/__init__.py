"""KV selection: which cached tokens each decode step attends to (DESIGN.md "KV selection")."""
from jkv.selection.base import Selector, SelectorConfig, selection_budget
from jkv.selection.registry import SELECTORS, get_selector, selector_config

__all__ = ["SELECTORS", "Selector", "SelectorConfig", "get_selector", "selection_budget", "selector_config"]
