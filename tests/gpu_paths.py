"""Makes the KV policies and the model's rotary and SiLU x up call, on CPU tensors, the Triton kernels they call on CUDA
(in place of the torch twins they call on the CPU), so the engine's GPU code paths run under
TRITON_INTERPRET=1. Used by tests/test_kernels_in_engine.py and scripts/count_step_ops.py; call it
before building an engine."""
from __future__ import annotations


def force_gpu_kernel_paths() -> None:
    from tests.triton_compat import squeeze_interpreted_indices

    squeeze_interpreted_indices()  # the interpreter of Triton 3.6 (torch 2.11) takes no loaded loop bound without it
    import oasiskv.models.llama as llama
    import oasiskv.policies.oasis as op
    import oasiskv.policies.sparse as sp
    import oasiskv.policies.tiered as tp
    from oasiskv.kernels import (block_mass, block_select, block_topk, draft_kv, host_gather, list_scores, miss_fill,
                                 residency, rotary, shortlist_mass, silu_mul, sparse_decode, tail_append)
    from oasiskv.kv import summaries, working_set

    llama.apply_rotary_qk_reference = rotary.apply_rotary_qk  # bit for bit the torch ops, so tokens stay equal
    llama.silu_mul_reference = silu_mul.silu_mul
    sp.select_blocks_padded = block_topk.select_blocks_fused
    sp.block_scores_reference = block_select.block_scores
    sp.sparse_decode_padded_reference = op.sparse_decode_padded_reference = \
        sparse_decode.sparse_decode_attention_padded
    sp.block_scores_multi_reference = block_select.block_scores_multi
    sp.block_mass_scores_multi_reference = block_mass.block_mass_scores_multi
    sp.shortlist_block_lse_reference = shortlist_mass.shortlist_block_lse
    sp.listed_scores_reference = list_scores.listed_scores
    op.predict_prefetch_reference = block_topk.predict_prefetch
    op.resident_selection_reference = residency.resident_selection
    op.fill_misses_reference = miss_fill.fill_misses
    op.write_draft_kv_reference = draft_kv.write_draft_kv
    tp.append_to_tails_reference = tail_append.append_to_tails
    tp.gather_host_blocks_reference = lambda host, pool, *copies: host_gather.gather_host_blocks(
        host, pool, *copies, programs=op.OasisPolicy.PREFETCH_PROGRAMS)
    ws_init, sum_init = working_set.WorkingSet.__init__, summaries.BlockSummaries.__init__

    def fused_ws(self, *a, **k):
        ws_init(self, *a, **{**k, "fused": True})

    def triton_summaries(self, *a, **k):
        sum_init(self, *a, **k)
        self.use_triton = True

    working_set.WorkingSet.__init__, summaries.BlockSummaries.__init__ = fused_ws, triton_summaries
