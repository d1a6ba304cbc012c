"""Page geometry and the page allocator (pure Python): allocation, reference counts, the null
page, OutOfPages, and a property test that random alloc/incref/decref sequences never hand out a
page twice and never leak one."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv.kvcache import NULL_PAGE, OutOfPages, PageAllocator, PageConfig


def test_page_config_validates_with_errors_naming_the_value():
    with pytest.raises(ValueError, match="page_size=0"):
        PageConfig(page_size=0)
    with pytest.raises(ValueError, match="num_pages=1 must be >= 2"):
        PageConfig(num_pages=1)
    with pytest.raises(TypeError, match="page_size=16.0"):
        PageConfig(page_size=16.0)
    with pytest.raises(ValueError, match="n_tokens=-1"):
        PageConfig().pages_for(-1)


def test_page_config_sizing_helpers():
    cfg = PageConfig(page_size=16, num_pages=5)
    assert (cfg.usable_pages, cfg.capacity_tokens) == (4, 64)
    assert [cfg.pages_for(n) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]
    assert PageConfig.for_tokens(33, page_size=16) == PageConfig(16, 4)  # 3 pages + null
    # 10 KiB a token, a 1 MiB budget: 102 tokens -> 6 pages of 16.
    assert PageConfig.for_bytes(1 << 20, 10 * 1024, page_size=16).num_pages == 6
    with pytest.raises(ValueError, match="holds 1 pages"):
        PageConfig.for_bytes(1500, 1024, page_size=1)


def test_allocate_never_hands_out_the_null_page_and_counts():
    alloc = PageAllocator(5)
    assert (alloc.capacity, alloc.num_free, alloc.num_used) == (4, 4, 0)
    pages = alloc.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4] and NULL_PAGE not in pages
    assert (alloc.num_free, alloc.num_used) == (0, 4)
    assert alloc.allocate(0) == []


def test_out_of_pages_names_needed_free_and_the_fix_and_allocates_nothing():
    alloc = PageAllocator(4)
    alloc.allocate(2)
    with pytest.raises(OutOfPages) as e:
        alloc.allocate(3)
    assert (e.value.needed, e.value.free) == (3, 1)
    assert "needs 3 free pages but only 1 of 3 are free" in str(e.value)
    assert "--num-pages" in str(e.value) and "concurrency" in str(e.value)
    assert alloc.num_free == 1


def test_refcounts_free_a_page_only_at_zero():
    alloc = PageAllocator(4)
    a, b = alloc.allocate(2)
    alloc.incref([a, a])
    assert alloc.refcount(a) == 3
    assert alloc.decref([a, b]) == [b]
    assert alloc.decref([a, a]) == [a]
    assert alloc.num_free == 3
    assert alloc.allocate(1) == [a]  # the most recently freed page comes back first


def test_decref_of_a_free_page_raises_and_changes_nothing():
    alloc = PageAllocator(4)
    a, b = alloc.allocate(2)
    alloc.decref([a])
    with pytest.raises(ValueError, match="double free"):
        alloc.decref([b, a])
    assert alloc.refcount(b) == 1  # b was not released by the failed call
    with pytest.raises(ValueError, match="double free"):
        alloc.decref([b, b])
    with pytest.raises(ValueError, match="are free"):
        alloc.incref([a])


@pytest.mark.parametrize("page", [NULL_PAGE, 9, -1])
def test_page_ids_outside_the_pool_or_the_null_page_are_refused(page):
    alloc = PageAllocator(9)
    with pytest.raises(ValueError, match="reserved null page"):
        alloc.decref([page])


@settings(max_examples=150, deadline=None)
@given(num_pages=st.integers(2, 12),
       ops=st.lists(st.tuples(st.sampled_from(["alloc", "incref", "decref"]), st.integers(0, 6)),
                    max_size=60))
def test_random_sequences_never_double_allocate_or_leak(num_pages, ops):
    alloc = PageAllocator(num_pages)
    refs: dict[int, int] = {}  # the model: page -> references held
    for op, n in ops:
        if op == "alloc":
            free_before = alloc.num_free
            if n > free_before:
                with pytest.raises(OutOfPages):
                    alloc.allocate(n)
                continue
            pages = alloc.allocate(n)
            assert len(set(pages)) == n and not set(pages) & set(refs), "a page handed out twice"
            refs.update({p: 1 for p in pages})
        elif refs:
            page = sorted(refs)[n % len(refs)]
            if op == "incref":
                alloc.incref([page])
                refs[page] += 1
            else:
                alloc.decref([page])
                refs[page] -= 1
                if not refs[page]:
                    del refs[page]
        assert alloc.num_used == len(refs) and alloc.num_free == alloc.capacity - len(refs)
        assert all(alloc.refcount(p) == c for p, c in refs.items())
    for page, count in list(refs.items()):
        alloc.decref([page] * count)
    assert alloc.num_free == alloc.capacity, "pages leaked"
    assert sorted(alloc.allocate(alloc.capacity)) == list(range(1, num_pages))
