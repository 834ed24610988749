"""The model runner: the target and draft models, their KV tensors, and every forward
the engine runs (draft expansion, the verification pass, logits and log-probabilities).

It knows nothing of queues or policies: the scheduler hands it a ``Batch`` whose
requests already hold the KV slots they need.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from adaserve.core.step import Batch
from adaserve.core.tree import CandidateTree, ancestor_mask
from adaserve.errors import InvalidRequestError, ModelLoadError
from adaserve.kv.cache import KVCache
from adaserve.models.attention import AttnMetadata, SeqSpec
from adaserve.models.config import ModelConfig
from adaserve.models.loader import load_model, resolve_dtype
from adaserve.spec_decode import grammar
from adaserve.spec_decode.batch import VerifyBatch
from adaserve.spec_decode.draft import DraftOutput, expand
from adaserve.spec_decode.logits import add_logit_bias, bad_word_bans, ban_tokens, make_generator
from adaserve.spec_decode.penalties import tree_paths
from adaserve.spec_decode.request import Request
from adaserve.text.tokenizer import Tokenizer, check_draft_tokenizer, load_tokenizer
from adaserve.util import paths, threads
from adaserve.util.resources import default_kv_budget, gpu_kv_budget

if TYPE_CHECKING:
    from adaserve.config import EngineConfig


@dataclass
class VerifyPass:
    """The verification forward of one step.

    requests:    the R requests of ``batch``, in its order (completing prefills, then
                 decodes)
    batch:       their flattened trees (``VerifyBatch``)
    logits:      [N, V] float32, the target's logits at every node of ``batch``
    prompt_rows: (request, first position p, log-probabilities [m, V]) of prefill rows
                 that score prompt tokens p+1..p+m (``params.prompt_logprobs``)
    """

    requests: list[Request]
    batch: VerifyBatch
    logits: torch.Tensor
    prompt_rows: list[tuple[Request, int, torch.Tensor]]


class ModelRunner:
    """Loads the pair named by an ``EngineConfig`` and runs its forwards."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        try:
            self.thread_plan = threads.choose(cfg.threads)
        except ValueError as e:
            raise InvalidRequestError(str(e), "threads") from None
        threads.apply(self.thread_plan)
        model_dir = Path(cfg.model) if cfg.model else paths.DEFAULT_TARGET
        draft_dir = None
        if not cfg.no_draft:
            if cfg.draft:
                draft_dir = Path(cfg.draft)
            elif cfg.model is None and paths.DEFAULT_DRAFT.is_dir():
                draft_dir = paths.DEFAULT_DRAFT
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ModelLoadError("device 'cuda' requested but CUDA is not available")
        ckpt_dtype = None
        if cfg.dtype == "auto" and self.device.type == "cuda":
            ckpt_dtype = ModelConfig.from_dir(model_dir).extra.get("torch_dtype")
        self.dtype = resolve_dtype(cfg.dtype, self.device, ckpt_dtype)
        self.model_dir = model_dir
        self.draft_dir = draft_dir
        rnd = cfg.random_weights
        self.target = load_model(model_dir, self.device, self.dtype, rnd)
        self.draft = load_model(draft_dir, self.device, self.dtype, rnd) if draft_dir else None
        self.tokenizer: Tokenizer | None = load_tokenizer(model_dir)
        if self.draft is not None and draft_dir:
            check_draft_tokenizer(self.tokenizer, load_tokenizer(draft_dir), draft_dir)
        tcfg = self.target.cfg
        self.eos_ids = set(tcfg.eos_token_ids)
        if not self.eos_ids and self.tokenizer is not None and self.tokenizer.eos_id is not None:
            self.eos_ids = {self.tokenizer.eos_id}
        if cfg.max_model_len is not None and cfg.max_model_len > tcfg.max_position_embeddings:
            raise ModelLoadError(
                f"max_model_len {cfg.max_model_len} is larger than the model's context "
                f"(max_position_embeddings={tcfg.max_position_embeddings} in "
                f"{model_dir / 'config.json'})"
            )
        self.max_model_len = cfg.max_model_len or tcfg.max_position_embeddings
        self.vocab_size = tcfg.vocab_size
        self.flops_per_token_target = 2.0 * tcfg.num_parameters()
        self.flops_per_token_draft = 2.0 * self.draft.cfg.num_parameters() if self.draft else 0.0
        esize = torch.tensor([], dtype=self.dtype).element_size()
        self.weight_bytes = (
            tcfg.num_parameters() * esize,
            self.draft.cfg.num_parameters() * esize if self.draft is not None else 0,
        )
        per_slot = tcfg.kv_bytes_per_token(esize)
        if self.draft is not None:
            per_slot += self.draft.cfg.kv_bytes_per_token(esize)
        self.kv_bytes_per_slot = per_slot
        budget = cfg.kv_cache_bytes
        if budget is None:
            budget = self._gpu_kv_budget() if self.device.type == "cuda" else default_kv_budget()
        self.num_blocks = int(max(4, budget // (per_slot * cfg.block_size)))
        num_slots = self.num_blocks * cfg.block_size
        self.kv_target = KVCache(tcfg, num_slots, self.device, self.dtype)
        self.kv_draft = (
            KVCache(self.draft.cfg, num_slots, self.device, self.dtype) if self.draft else None
        )
        self._seeds = random.Random(cfg.seed) if cfg.seed is not None else None
        self.model_time_s = 0.0  # seconds spent in forwards (read and reset by the engine)
        # the draft's forward passes of the last ``draft_trees``: (tokens, context) each
        self.draft_passes: list[tuple[int, int]] = []
        self._tpot_estimate: float | None = None

    def _gpu_kv_budget(self) -> int:
        """KV bytes on this GPU once the models are loaded (``gpu_kv_budget``); the
        activation reserve holds float32 logits for a full batch of trees (64 nodes a
        request) and a prefill chunk, twice (softmax), plus 1 GiB."""
        cfg, t = self.cfg, self.target.cfg
        free, total = torch.cuda.mem_get_info(self.device)
        rows = cfg.max_prefill_tokens + 64 * cfg.max_num_seqs
        activations = (1 << 30) + 2 * rows * t.vocab_size * 4
        try:
            return gpu_kv_budget(total, free, cfg.gpu_memory_utilization, t.num_layers, activations)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None

    # ------------------------------------------------------------------ inputs
    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (a string needs a tokenizer)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer.json: pass prompts as token ids", "prompt"
                )
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        V = self.vocab_size
        if not all(isinstance(t, int) and 0 <= t < V for t in ids):
            raise InvalidRequestError(f"token ids must be integers in [0, {V})", "prompt")
        return ids

    def generator(self, seed: int | None) -> torch.Generator:
        """A request's own random generator on the device; an unseeded request's is
        seeded from the engine's ``seed`` when one is set (reproducible runs, as
        vLLM's ``--seed``)."""
        if seed is None and self._seeds is not None:
            seed = self._seeds.getrandbits(63)
        return make_generator(seed, self.device)

    def estimate_tpot_ms(self) -> float:
        """Per-token latency of an unloaded one-token decode (measured once, cached)."""
        if self._tpot_estimate is None:
            ids = torch.zeros(1, 8, dtype=torch.long, device=self.device)
            with torch.inference_mode():
                self.target.forward_dense(ids)
                t0 = time.perf_counter()
                for _ in range(3):
                    self.target.forward_dense(ids[:, :1])
                self._tpot_estimate = (time.perf_counter() - t0) / 3 * 1000
        return self._tpot_estimate

    # ------------------------------------------------------------------ forwards
    def draft_trees(
        self,
        spec: list[tuple[Request, tuple[int, int]]],
        noise_std: float,
        forced: list[list[int]] | None = None,
    ) -> dict[int, DraftOutput]:
        """Beam-expand one candidate tree per (request, (depth, width)) with the draft
        (below each request's ``forced`` chain of grammar-forced tokens). The draft's
        forward passes, (tokens fed, context tokens attended) each, are left in
        ``draft_passes``."""
        self.draft_passes = []
        if not spec:
            return {}
        reqs = [r for r, _ in spec]
        assert self.draft is not None and self.kv_draft is not None  # spec needs a draft
        t0 = time.perf_counter()
        outs = expand(
            self.draft,
            self.kv_draft,
            reqs,
            [s for _, s in spec],
            sample=self.cfg.draft_sample,
            noise_std=noise_std,
            vocab_size=self.vocab_size,
            forced=forced,
            passes=self.draft_passes,
        )
        self.model_time_s += time.perf_counter() - t0
        return {r.rid: o for r, o in zip(reqs, outs)}

    @torch.inference_mode()
    def verify_forward(
        self, batch: Batch, trees: dict[int, CandidateTree], drafts: dict[int, DraftOutput]
    ) -> VerifyPass | None:
        """One target forward over the batch's prefill chunks and trees (None when the
        batch is empty).

        The pass's ``VerifyBatch`` is laid out with the forward: one request for each
        prefill that completes its prompt (root only, at its last token's row), then
        each decoding request's 1+N tree nodes (root first); its logits [N, V] float32
        are in that node order."""
        t0 = time.perf_counter()
        seqs, ids = [], []
        vtrees, vreqs, first_rows = [], [], []
        q_rows: list[Any] = []
        extra: list[tuple[Request, int, int, int]] = []  # (request, position, row, count)
        pos = 0
        for r, n in batch.prefill:
            nc = r.num_cached
            seqs.append(
                SeqSpec(r.table.slots(0, nc), r.table.slots(nc, nc + n), list(range(nc, nc + n)))
            )
            ids.extend(r.tokens[nc : nc + n])
            if nc + n == len(r.tokens):
                vtrees.append(CandidateTree.root_only(r.tokens[-1]))
                vreqs.append(r)
                first_rows.append(pos + n - 1)
                q_rows.append(None)
            if r.params.prompt_logprobs is not None:
                # rows nc..: the distributions of prompt tokens nc+1.. (not the output's)
                m = min(n, len(r.prompt_ids) - 1 - nc)
                if m > 0:
                    extra.append((r, nc, pos, m))
            pos += n
        for r in batch.decode:
            t = trees[r.rid]
            C = len(r.tokens)
            k = len(t.tokens)
            seqs.append(
                SeqSpec(
                    r.table.slots(0, C - 1),
                    r.table.slots(C - 1, C - 1 + k),
                    (C - 1 + t.depth).tolist(),
                    new_mask=ancestor_mask(t.parents) if k > 1 else None,
                )
            )
            ids.extend(t.tokens.tolist())
            vtrees.append(t)
            vreqs.append(r)
            first_rows.append(pos)
            d = drafts.get(r.rid)
            q_rows.append(d.q_rows if d is not None and self.cfg.draft_sample else None)
            pos += k
        if not seqs:
            return None
        vb = VerifyBatch.build(
            vtrees,
            [r.params for r in vreqs],
            [r.gen for r in vreqs],
            device=self.device,
            first_rows=first_rows,
            draft_q=q_rows,
            # every root predicts the token after the request's committed ones
            out_index=[len(r.tokens) - r.prompt_len for r in vreqs],
            histories=[(r.prompt_ids, r.output_ids) if r.params.penalized else None for r in vreqs],
        )
        meta = AttnMetadata.build(seqs, self.device, self.target.cfg.sliding_window)
        hidden = self.target(
            torch.tensor(ids, dtype=torch.long, device=self.device), meta, self.kv_target.layers
        )
        logits = self.target.logits(hidden[vb.hidden_rows])
        for i, r in enumerate(vreqs):  # before the masks: a bias never revives a token
            if r.params.logit_bias:
                add_logit_bias(
                    logits, range(int(vb.cu_nodes[i]), int(vb.cu_nodes[i + 1])), r.params.logit_bias
                )
        ban_bad_words(logits, vb, vreqs, vtrees)
        mask_min_tokens(logits, vb, vreqs, self.eos_ids)
        mask_grammar(logits, vb, vreqs, vtrees, drafts)
        prompt_rows = []
        if extra:
            rows = [i for _, _, row, m in extra for i in range(row, row + m)]
            lsm = torch.log_softmax(
                self.target.logits(hidden[torch.tensor(rows, device=self.device)]), dim=-1
            )
            at = 0
            for r, p, _, m in extra:
                prompt_rows.append((r, p, lsm[at : at + m]))
                at += m
        self.model_time_s += time.perf_counter() - t0
        return VerifyPass(vreqs, vb, logits, prompt_rows)

    def move_target_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy the target's KV of slots ``src`` to ``dst`` (tree compaction)."""
        if src:
            dev = self.device
            self.kv_target.move_slots(torch.tensor(src, device=dev), torch.tensor(dst, device=dev))


def mask_min_tokens(logits: torch.Tensor, vb, reqs: list[Request], eos_ids: set[int]) -> None:
    """In place: the logits of EOS and the stop token ids at -inf in every row whose
    token would be an output token below ``params.min_tokens`` (the row of the node at
    depth d of request r: output index ``out_index[r] + d``). Done on the target's logits
    before verification, so greedy, seeded and sampled verification (and the bonus
    token) all see the same processed distribution: a drafted stop token there is
    rejected, never accepted."""
    cu, depth_of = vb.cu_nodes, None
    for i, r in enumerate(reqs):
        p = r.params
        o = len(r.tokens) - r.prompt_len
        if p.min_tokens <= o:
            continue
        ids = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_ids)
        if not ids:
            continue
        if depth_of is None:
            depth_of = _node_depths(vb)
        lo, hi = int(cu[i]), int(cu[i + 1])
        rows = [n for n in range(lo, hi) if o + depth_of[n] < p.min_tokens]
        if rows:
            dev = logits.device
            r_idx = torch.tensor(rows, device=dev)[:, None]
            c_idx = torch.tensor(sorted(ids), device=dev)[None, :]
            logits[r_idx, c_idx] = float("-inf")


def ban_bad_words(logits: torch.Tensor, vb, reqs: list[Request], trees) -> None:
    """In place: at every node of a request with ``bad_words``, the last token of each
    bad word the committed output plus the node's path would complete is -inf (the
    draft bans the same): such a word is never generated, and speculation stays
    lossless."""
    bans = []
    for i, r in enumerate(reqs):
        if not r.bad_words_ids:
            continue
        t, out, lo = trees[i], r.output_ids, int(vb.cu_nodes[i])
        for n, path in enumerate(tree_paths(t.parents, t.tokens)):
            ids = bad_word_bans(out + path, r.bad_words_ids)
            if ids:
                bans.append((lo + n, ids))
    ban_tokens(logits, bans)


def mask_grammar(logits: torch.Tensor, vb, reqs: list[Request], trees, drafts) -> None:
    """In place: each constrained request's node rows keep only the tokens its grammar
    allows after that node's path (the draft's masks reused where it computed them),
    so the verifier samples from the target distribution masked at every node: a
    drafted token the grammar forbids is never accepted, and the bonus is always
    allowed."""
    cu = vb.cu_nodes
    rows: list[Any] = []
    masks: list[Any] = []
    for i, r in enumerate(reqs):
        gs = r.grammar
        if gs is None:
            continue
        t = trees[i]
        d = drafts.get(r.rid)
        cached = d.masks if d is not None else {}
        origin = t.origin if t.origin is not None else range(len(t.tokens))
        paths = tree_paths(t.parents, t.tokens)
        need = [n for n in range(len(t.tokens)) if int(origin[n]) not in cached]
        fresh = dict(zip(need, gs.masks([paths[n] for n in need]))) if need else {}
        for n in range(len(t.tokens)):
            masks.append(fresh[n] if n in fresh else cached[int(origin[n])])
        rows.extend(range(int(cu[i]), int(cu[i + 1])))
    if rows:
        grammar.apply(logits, rows, np.stack(masks))


def _node_depths(vb) -> list[int]:
    """Depth of every node of a verify batch (parents precede children)."""
    par = vb.parents.tolist()
    depth = [0] * len(par)
    for n, q in enumerate(par):
        if q != n:
            depth[n] = depth[q] + 1
    return depth


def logprob_entries(lsm: torch.Tensor, ids: list[int], k: int) -> list:
    """lsm: [n, V] log-probabilities; ids: the n tokens taken -> per token
    (its logprob, ((id, logprob) of the k most likely, best first))."""
    chosen = lsm.gather(1, torch.tensor(ids, device=lsm.device)[:, None])[:, 0].tolist()
    if not k:
        return [(c, ()) for c in chosen]
    top = lsm.topk(k, dim=-1)
    alts = [tuple(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
    return list(zip(chosen, alts))
