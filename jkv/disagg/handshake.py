"""The configuration prefill and decode agree on before any KV crosses (issue 21, item 3).

A prefill worker and a decode worker exchange a `RoleConfig` inside the transport handshake
(transport/auth.py: the client's AUTH and the server's WELCOME carry it; the listening prefill
worker checks the decode side's before it answers, the decode side checks the prefill worker's
before it adopts the connection). A mismatch refuses the connection with an error naming the
field and both values, on both sides, e.g.

    decode runs dtype=bfloat16 but prefill runs float32: start both roles with the same --dtype

so a mismatched pair never exchanges bytes that decode would read as KV: no region is written and
no message is read before the check passes.

Fields, in the order they are checked (the first mismatch is reported):

    protocol         the control-plane protocol version (jkv/disagg/protocol.py)
    model            the model id: a registered name, or the checkpoint's file/directory name
    dtype            weights/activations dtype
    kv_dtype         dtype of KV rows on the wire and in the host pools (float32 today)
    num_layers, num_kv_heads, head_dim    the KV geometry
    head_order       which model KV head a wire head index is ("global": head h is the model's
                     head h on both sides, whatever either side's tensor-parallel split; a pushed
                     block's KV-head slice [start, stop) indexes this order, jkv/disagg/head_slices.py)
    max_blocks       M, transfer blocks per layer; a prefill worker follows the M each request
                     names, so a standalone one declares None (no constraint)
    page_size        tokens per page of the receiving KV cache; None today: KV lands in
                     per-request contiguous host pools addressed by token row (the paged device
                     cache of [kvstore] declares its page size here)
    tensor_parallel  the TP degree of the role's model (`Model.tensor_parallel`): declared (and shown
                     on /health), never compared. Blocks carry KV-head slices in global order
                     (head_order), the receiver lands each row in the shard of its own mesh that
                     holds its head, so a prefill at TP 2 feeds a decode at TP 1 and the reverse
                     (docs/scale.md)
    kv_head_slices   the KV-head ranges of the role's layout, "0:1,1:2" (a prefill worker pushes one
                     block per range; "0:H_kv" when heads are not split): declared, not compared
                     (any split lands on any other), but a peer's must split this side's
                     num_kv_heads into ranges covering each head once, or the connection is refused
    selector         the sparse-attention selector (prefill ships its metadata to decode)
    compression      the KV compression format: container version and stage registry
    weights          a fingerprint of the weights (checked last: a different model or dtype
                     changes it too, and those fields name the cause better)

A None on either side means "this side adapts to the peer" and is never a mismatch. `role`,
`tensor_parallel` and `kv_head_slices` are declared only (`DECLARED_ONLY`).

Weights fingerprint: a hash of every parameter's path, shape and dtype plus `SAMPLE_VALUES` values
at evenly spaced flat positions, computed once per loaded model and cached. Sampled, not a full
hash: a full pass costs seconds per start for a multi-GB checkpoint (and per restarted worker),
while a different checkpoint, fine-tune, quantisation or dtype conversion changes essentially
every value and so shows in any sample; a handful of edited weights would not, and is not what
this check is for. Both roles read the same file with the same conversion code, so the sampled
bytes are bit-identical when the weights are. On the host the samples are read in place (SmolLM2's
272 tensors in milliseconds); on an accelerator one jitted gather moves only the samples.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import weakref

import numpy as np

from jkv.disagg.head_slices import format_slices, head_slices, parse_slices
from jkv.disagg.protocol import PROTOCOL_VERSION
from transport import ConfigCheck

SAMPLE_VALUES = 256
KV_DTYPE = "float32"  # jkv.kvbuffers.pool.KVBufferPool rows
HEAD_ORDER = "global"

SAME_RELEASE = "run the same jkv release on both roles"
SAME_MODEL = "start both roles with the same --model"
_FIX = {
    "protocol": SAME_RELEASE,
    "model": SAME_MODEL,
    "dtype": "start both roles with the same --dtype",
    "kv_dtype": SAME_RELEASE,
    "num_layers": SAME_MODEL,
    "num_kv_heads": SAME_MODEL,
    "head_dim": SAME_MODEL,
    "head_order": SAME_RELEASE,
    "max_blocks": "start both roles with the same --max-blocks",
    "page_size": "start both roles with the same KV page size",
    "selector": "start both roles with the same --selector (or --selector-file)",
    "compression": SAME_RELEASE,
    "weights": "both roles must load the same checkpoint file with the same --dtype",
}

DECLARED_ONLY = ("role", "tensor_parallel", "kv_head_slices")  # in the handshake, never a mismatch

_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class RoleConfig:
    """What one role declares in the handshake (see the module docstring for each field)."""

    role: str  # "prefill" or "decode": names the sides in messages, never compared
    protocol: int
    model: str
    dtype: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    head_order: str
    max_blocks: int | None
    page_size: int | None
    tensor_parallel: int
    kv_head_slices: str | None
    selector: str
    compression: str
    weights: str

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def mismatch(self, peer: dict | None) -> str | None:
        """The refusal reason for a peer that declared `peer` (None: it declared nothing), or None."""
        if peer is None:
            return (f"the peer sent no configuration in its handshake (a jkv older than control protocol "
                    f"{PROTOCOL_VERSION}): {SAME_RELEASE}")
        them = str(peer.get("role", "the peer"))
        for name, fix in _FIX.items():
            if name not in peer:
                return f"{them} sent no {name} in its handshake configuration: {SAME_RELEASE}"
            mine, theirs = getattr(self, name), peer[name]
            if mine is not None and theirs is not None and mine != theirs:
                return f"{self.role} runs {name}={mine} but {them} runs {theirs}: {fix}"
        slices = peer.get("kv_head_slices")
        if slices is not None:  # validated here, so no block with a bad head range is ever addressed
            try:
                parse_slices(slices, self.num_kv_heads)
            except ValueError as e:
                return f"{them} declares kv_head_slices={slices!r}, not a split of {self.role}'s KV heads: {e}"
        return None

    def check(self) -> ConfigCheck:
        """The transport's handshake hook for an endpoint of this role."""
        return ConfigCheck(self.as_dict(), self.mismatch)


def role_config(model, role: str, selector, *, max_blocks: int | None, page_size: int | None = None,
                tensor_parallel: int | None = None) -> RoleConfig:
    """The RoleConfig of a role serving `model` with `selector` (computes the weights fingerprint
    on first use per model object); tensor_parallel defaults to the model's own degree."""
    cfg = model.cfg
    if tensor_parallel is None:
        tensor_parallel = getattr(model, "tensor_parallel", 1)
    slices = format_slices(head_slices(getattr(model, "kv_sharding", None), cfg.num_kv_heads))
    return RoleConfig(role=role, protocol=PROTOCOL_VERSION, model=model_id(model), dtype=str(cfg.dtype),
                      kv_dtype=KV_DTYPE, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                      head_dim=cfg.head_dim, head_order=HEAD_ORDER, max_blocks=max_blocks, page_size=page_size,
                      tensor_parallel=tensor_parallel, kv_head_slices=slices, selector=selector.name,
                      compression=compression_version(), weights=weights_fingerprint(model))


def model_id(model) -> str:
    """The registered name, or the checkpoint's file/directory name (a path may differ per machine)."""
    name = str(getattr(model, "name", "") or model.cfg.family).rstrip("/\\")
    return os.path.basename(name)[-200:] or name[-200:]


def weights_fingerprint(model, *, gather_on_device: bool | None = None) -> str:
    """16 hex digits over every parameter's path, shape, dtype and sampled values (cached per model).
    gather_on_device: sample with one jitted gather (None: only when a parameter is off the host;
    a CPU buffer is read in place, with no copy and no compile)."""
    if gather_on_device is None:
        try:
            return _fingerprints[model]
        except (KeyError, TypeError):
            pass
    import jax
    import jax.numpy as jnp

    leaves = jax.tree_util.tree_leaves_with_path(model.params)
    positions = [np.unique(np.linspace(0, max(leaf.size - 1, 0), min(leaf.size, SAMPLE_VALUES)).astype(np.int64))
                 for _, leaf in leaves]
    if gather_on_device is None:
        gather_on_device = any(d.platform != "cpu" for _, x in leaves for d in getattr(x, "devices", lambda: ())())
    if gather_on_device:  # one program for every sample, so only the samples leave the accelerator
        samples = jax.jit(lambda ls: [jnp.ravel(x)[p] for x, p in zip(ls, positions)])([x for _, x in leaves])
    else:
        samples = [np.asarray(x).reshape(-1)[p] for (_, x), p in zip(leaves, positions)]
    h = hashlib.blake2b(digest_size=8)
    for (path, leaf), sample in zip(leaves, samples):
        h.update(f"{jax.tree_util.keystr(path)}|{tuple(leaf.shape)}|{leaf.dtype}|".encode())
        h.update(np.asarray(sample).tobytes())
    digest = h.hexdigest()
    try:
        _fingerprints[model] = digest
    except TypeError:  # not weak-referenceable: recomputed next time
        pass
    return digest


def compression_version() -> str:
    """The KV compression format: container version and a digest of the stage names and wire dtype
    (a stage added or renamed on one side only changes it)."""
    from jkv.compression import container, kv_transfer, spec

    stages = "|".join([",".join(spec.TRANSFORMS), ",".join(spec.QUANTIZERS), ",".join(spec.CODECS),
                       np.dtype(kv_transfer.WIRE_DTYPE).name])
    return f"container-v{container.VERSION}/{hashlib.blake2b(stages.encode(), digest_size=4).hexdigest()}"
