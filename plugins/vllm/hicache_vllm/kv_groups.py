"""vLLM's KV cache groups as the connector serves them, and the kinds it refuses.

Under vLLM's hybrid KV cache manager (HMA) the layers of a model fall into groups, each with
a block table of its own: full attention, sliding-window attention, Mamba or linear-attention
state. Every group is a tier of its own here (`groups.py`): its pages hold its own layers'
blocks, and its namespace names its kind and spec, so no group's object is ever read as
another's. A sliding-window layer reads back only `reach` tokens before a position, so at a
cached boundary only the pages in that reach are worth loading: vLLM leaves the blocks before
them null. A linear-attention (gated delta-net) group in vLLM's `align` mode keeps one state
block per cached boundary: its page is that block's bytes (a conv and an SSM state in one
padded page), the state after the page's last token, so it reads back exactly one page, its
boundary's own. A kind whose bytes we cannot yet name or place, or a state kernel no engine
test here shows exact (Mamba2), is refused at start, one line.
"""
from __future__ import annotations

from dataclasses import dataclass

from hicache_async.errors import UsageError

# state kernels whose groups are served: each shown exact in a real engine (`test_hybrid.py`);
# vLLM's CPU Mamba2 scan cannot run one there (it ignores `return_intermediate_states`)
STATE_KINDS = ("GDN_ATTN",)


@dataclass(frozen=True)
class Group:
    """One KV cache group: its kind, what a layer of it reads back, and its layers."""

    index: int
    kind: str                   # "full", "sliding" or "state" (Mamba, linear attention)
    reach: int                  # tokens before a position a layer still reads (0: all of them)
    layers: tuple[str, ...]
    spec: str                   # everything that decides its pages' bytes, for the namespace

    def first_read(self, boundary: int, page_size: int) -> int:
        """The first page a layer of this group reads for the token after `boundary` pages."""
        if not self.reach:
            return 0
        return max(0, boundary * page_size - self.reach) // page_size


def groups_of(kv_cache_config, page_size: int, pipeline_size: int = 1) -> list[Group]:
    """The groups of `kv_cache_config` (vLLM's `KVCacheConfig`), each checked to be one we
    can serve; any other stops start-up with one line naming it."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    groups = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            kind, reach = "full", 0
        elif type(spec) is SlidingWindowSpec:
            kind, reach = "sliding", spec.sliding_window - 1 + spec.extra_retained_tokens
        elif (type(spec) is MambaSpec and spec.mamba_cache_mode == "align" and not spec.num_speculative_blocks
              and spec.mamba_type.name in STATE_KINDS):
            kind, reach = "state", spec.block_size      # the boundary's own state block, nothing before it
        elif type(spec) is MambaSpec and spec.mamba_type.name not in STATE_KINDS:
            raise UsageError(f"HiCacheConnector: KV cache group {i} keeps {spec.mamba_type.name} state; only "
                             f"{', '.join(STATE_KINDS)} state is cached so far (served in an engine test here)")
        elif type(spec) is MambaSpec:
            raise UsageError(f"HiCacheConnector: KV cache group {i} keeps Mamba state in mamba_cache_mode="
                             f"{spec.mamba_cache_mode!r} with {spec.num_speculative_blocks} speculative blocks; "
                             f"only 'align' mode without them saves a state at each boundary (turn prefix caching on)")
        else:
            raise UsageError(f"HiCacheConnector: KV cache group {i} is {type(spec).__name__} "
                             f"({len(group.layer_names)} layers); only full-attention and sliding-window "
                             f"groups are cached so far")
        if spec.block_size != page_size:
            raise UsageError(f"HiCacheConnector: KV cache group {i} has blocks of {spec.block_size} tokens, "
                             f"not the {page_size} a page holds")
        groups.append(Group(i, kind, reach, tuple(group.layer_names),
                            f"{kind}:reach={reach}:block={spec.block_size}:{type(spec).__name__}" + _state_of(spec)))
    if len(groups) > 1 and pipeline_size > 1:
        raise UsageError(f"HiCacheConnector: {len(groups)} KV cache groups with pipeline_parallel_size="
                         f"{pipeline_size} are not supported: a group's pages would span stages")
    return groups


def _state_of(spec) -> str:
    """What decides a state page's bytes beyond its kind: the kernel family, each state's shape
    and dtype, and the padded page; empty for attention (its layout names its shape)."""
    if not hasattr(spec, "shapes"):
        return ""
    states = ",".join(f"{'x'.join(map(str, shape))}/{str(dtype).removeprefix('torch.')}"
                      for shape, dtype in zip(spec.shapes, spec.dtypes))
    return f":{spec.mamba_type.name}:states={states}:page={spec.page_size_bytes}"
