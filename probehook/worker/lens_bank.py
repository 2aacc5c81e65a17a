"""Lenses inside the worker: each kept row read through a lens's affine map, the model's own
final norm and unembedding, and cut to its top-k next tokens and the target's log-prob.

The bank is a selective recorder transform (each ``(lens, layer)`` instance on the rows of the
requests that asked for it) that also reads each row's next token (``next_tokens``). It reads
the step's rows before sampling (so lens monitors can stop a request in that step's sampler);
the target of a request's newest row, the token sampled from it, is not known then: the bank
keeps that row's log-sum-exp, and :meth:`LensBank.complete` fills its target after sampling
from one row of the unembedding (``token_logits``; the whole head where the model has none
probehook can read). Logits are ``[rows, vocab]`` float32, so rows go through in tiles that
bound that memory; only ``[rows, 2k + 1]`` per instance leaves the device.

No vLLM imports: the model's head comes from the adapter as a callable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from probehook.outputs.top_k import carried_indices, carry_indices, pad_indices, pad_top_k
from probehook.worker.on_device import on_device

LOGITS_TILE_BYTES = 64 * 2**20
"""Float32 logits one tile of rows may hold (the tile is at least one row)."""
TOGETHER_ROWS = 256
"""A step's instances whose rows number fewer go through the head in one tile (decode)."""


class LensBank:
    """The lenses of one worker, callable on a recorder's staged rows (in :attr:`layers`
    order) with each row's next token: returns ``[len(slots), rows, 2k + 1]`` float32
    (token ids, log-probs, target log-prob)."""

    dtype = torch.float32
    selective = True
    reads_next_token = True

    def __init__(
        self,
        instances: Mapping[str, Mapping[str, Any]],
        k: int,
        head: Callable[[torch.Tensor], torch.Tensor],
        token_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        shard: Any = None,
    ) -> None:
        """``head(rows)``: the model's final norm and unembedding, ``[n, hidden]`` (the model's
        dtype) -> ``[n, vocab]`` logits as the model computes them; ``token_logits(rows,
        ids)``: the same for one token per row, ``[n]`` (None: the head's column);
        ``shard``: under tensor parallelism, the rank's vocabulary shard (the adapter's
        ``VocabShard``): every rank reads its shard in step, and one all-gather per tile
        merges the partial top-k lists, log-sum-exps and targets."""
        if not instances:
            raise ValueError("a LensBank needs at least one instance")
        self.slots = tuple(instances)
        self.k = int(k)
        self.width = 2 * self.k + 1
        self.head = head
        self.token_logits = token_logits
        self.shard = shard
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        """Rows read without their next token: ``(slot, rows of the step's block, the rows
        as the head reads them, their log-sum-exp)``, until :meth:`complete`."""
        self._vocab = 0  # set with the tile
        self._tile_rows: int | None = None
        """Rows a tile of logits holds (LOGITS_TILE_BYTES), set at the first read."""
        self.layers = tuple(sorted({int(s["layer"]) for s in instances.values()}))
        loaded: dict[str, Any] = {}
        ranks = shard.ranks if shard is not None else 1
        self._instances: list[tuple[int, torch.Tensor | None, torch.Tensor | None]] = []
        self._sharded: list[bool] = []
        """Per instance: its matrix holds this rank's slice of the mapped row's columns (one
        all-gather a step joins them), not the whole matrix on every rank."""
        for settings in instances.values():
            layer = int(settings["layer"])
            matrix = bias = None
            if settings["kind"] != "logit":
                from probehook.lenses.artifacts import lens_affine, load_lens

                path = str(settings["path"])
                if path not in loaded:  # one read per file, whatever its layers
                    loaded[path] = load_lens(path)
                matrix, bias = lens_affine(loaded[path], layer, int(settings["num_layers"]))
                dtype = getattr(torch, settings.get("dtype") or "float32")  # lens_dtype
                matrix = matrix.to(dtype) if matrix is not None else None
                bias = bias.to(dtype) if bias is not None else None
            sharded = ranks > 1 and matrix is not None and matrix.shape[0] % ranks == 0
            if sharded:  # each rank keeps its rows of the matrix (output columns)
                assert matrix is not None and shard is not None
                part = matrix.shape[0] // ranks
                at = slice(shard.rank * part, (shard.rank + 1) * part)
                matrix = matrix[at].clone()  # a copy: the whole matrix is freed
                bias = bias[at].clone() if bias is not None else None
            self._instances.append((self.layers.index(layer), matrix, bias))
            self._sharded.append(sharded)
        self.device: torch.device | None = None

    def to(self, device: torch.device | str) -> LensBank:
        """The lens matrices on ``device`` (the model's), at load."""
        self._instances = [
            (slot, m.to(device) if m is not None else None, b.to(device) if b is not None else None)
            for slot, m, b in self._instances
        ]
        self.device = torch.device(device)
        return self

    def __call__(
        self,
        staged: torch.Tensor | Sequence[torch.Tensor],
        slot_rows: Sequence[np.ndarray] | None = None,
        next_tokens: torch.Tensor | None = None,
        unknown: np.ndarray | None = None,
    ) -> torch.Tensor:
        """``next_tokens``: ``[rows]`` int64, the token that came after each row (None: not
        known; the target log-prob is NaN); ``unknown``: where in the rows it is -1 because
        this step's sampling draws it (the step context's, on the host: no device sync; None:
        read from ``next_tokens`` on the device)."""
        rows = staged[0].shape[0]
        device = staged[0].device
        if next_tokens is None:
            next_tokens = torch.full((rows,), -1, dtype=torch.int64, device=device)
        out = torch.empty((len(self._instances), rows, self.width), dtype=self.dtype,
                          device=device)  # fmt: skip
        self._pending = []
        # Every instance's rows, mapped, go through the head together: a step's fixed costs
        # (kernel launches, top-k, log-sum-exp, the host's work) are paid once, not once an
        # instance (four logit-lens layers at decode ran at 0.91 of their FLOP floor).
        parts = []  # (slot, asked rows or None: all, mapped rows, their next tokens)
        for slot, (layer_slot, matrix, bias) in enumerate(self._instances):
            asked = None if slot_rows is None else slot_rows[slot]
            if asked is not None and len(asked) == rows:
                asked = None
            h, targets = staged[layer_slot], next_tokens
            if asked is not None:
                if not len(asked):  # nobody asked: padding, which no request reads
                    pad_top_k(out[slot], self.k)
                    continue
                where = on_device(asked, device)
                h, targets = h.index_select(0, where), next_tokens.index_select(0, where)
            parts.append((slot, asked, self._map(h, matrix, bias, self._sharded[slot]), targets))
        if not parts:
            return out
        sizes = [p[2].shape[0] for p in parts]
        # A large step's tiles hold one instance's rows, as before (their logits stay in
        # cache: four prefill instances together ran at 0.91 of the floor, apart at 0.99);
        # a small step's instances (decode) go through as one tile.
        mapped = parts[0][2] if len(parts) == 1 else torch.cat([p[2] for p in parts])
        targets = parts[0][3] if len(parts) == 1 else torch.cat([p[3] for p in parts])
        packed, lse = self.read(mapped, targets, tile_cap=max(max(sizes), TOGETHER_ROWS))
        for (slot, asked, mapped, targets), mine, mine_lse in zip(
            parts, packed.split(sizes), lse.split(sizes), strict=True
        ):
            if asked is None:
                out[slot].copy_(mine)
            else:
                pad_top_k(out[slot], self.k)
                out[slot].index_copy_(0, torch.from_numpy(asked).to(device), mine)
            held = _held(unknown, asked, rows, targets)  # drawn after this: on the host
            if len(held):
                at = on_device(held, device)
                block_rows = held if asked is None else asked[held]
                self._pending.append(
                    (slot, block_rows, mapped.index_select(0, at), mine_lse.index_select(0, at))
                )
        return out

    def complete(
        self, out: torch.Tensor, next_tokens: Callable[[np.ndarray], torch.Tensor] | None
    ) -> None:
        """Fill the target log-prob of the rows :meth:`__call__` read without their next token
        (``out``: what it returned), from ``next_tokens`` (rows of the block -> their tokens,
        -1 where none came; None: none known, the targets stay NaN)."""
        pending, self._pending = self._pending, []
        if next_tokens is None or not pending:
            return
        on_host = np.concatenate([block_rows for _, block_rows, _, _ in pending])
        sizes = [len(block_rows) for _, block_rows, _, _ in pending]
        drawn = next_tokens(on_host).split(sizes)
        for (slot, block_rows, mapped, lse), tokens in zip(pending, drawn, strict=True):
            tokens = tokens.to(mapped.device)
            vocab = self._vocab
            known = (tokens >= 0) & (tokens < vocab)
            ids = tokens.clamp(0, vocab - 1)
            if self.shard is not None:  # the rank that holds the token has its logit
                mine = self.shard.token_logits(mapped, ids).float().unsqueeze(1)
                logits = self.shard.all_gather(mine).max(dim=1).values
            elif self.token_logits is not None:
                logits = self.token_logits(mapped, ids).float()
            else:
                logits = self.head(mapped).float().gather(1, ids.unsqueeze(1)).squeeze(1)
            target = torch.where(known, logits - lse, float("nan"))
            where = on_device(block_rows, out.device)
            out[slot, :, 2 * self.k].index_copy_(0, where, target)

    def read(
        self,
        rows: torch.Tensor,
        targets: torch.Tensor,
        tile_cap: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` ``[n, hidden]`` (mapped by their lens: :meth:`_map`) and their next tokens
        ``[n]`` (-1: not known) -> packed ``[n, 2k + 1]`` and each row's log-sum-exp ``[n]``, in
        tiles of at most ``tile_cap`` rows (and of the logits :data:`LOGITS_TILE_BYTES` hold)."""
        n = rows.shape[0]
        out = torch.empty((n, self.width), dtype=torch.float32, device=rows.device)
        lse = torch.empty((n,), dtype=torch.float32, device=rows.device)
        start = 0
        if self._tile_rows is None:  # the vocabulary is known once one row went through
            out[:1], lse[:1], self._vocab = self._one(rows[:1], targets[:1])
            self._tile_rows = max(1, LOGITS_TILE_BYTES // (4 * self._vocab))
            start = 1
        tile_rows = min(self._tile_rows, tile_cap or self._tile_rows)
        while start < n:
            stop = min(n, start + tile_rows)
            tile = self._one(rows[start:stop], targets[start:stop])
            out[start:stop], lse[start:stop] = tile[0], tile[1]
            start = stop
        return out, lse

    def _map(
        self,
        rows: torch.Tensor,
        matrix: torch.Tensor | None,
        bias: torch.Tensor | None,
        sharded: bool = False,
    ) -> torch.Tensor:
        """The lens's affine map of ``rows``, in the map's dtype (``lens_dtype``; float32
        unless asked), back in theirs; ``sharded``: ``matrix`` is this rank's slice of the
        output columns, joined across the ranks (every rank maps the same rows in step)."""
        if matrix is None:
            return rows
        x = rows.to(matrix.dtype) @ matrix.T
        if bias is not None:
            x = x + bias
        if sharded:
            x = self.shard.all_gather(x)
        return x.to(rows.dtype)

    @property
    def nbytes(self) -> int:
        """What the lens matrices and biases hold on this rank."""
        return sum(
            t.numel() * t.element_size()
            for _, matrix, bias in self._instances
            for t in (matrix, bias)
            if t is not None
        )

    def _one(
        self, rows: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One tile of mapped rows through the head: packed rows, log-sum-exps, vocabulary."""
        if self.shard is not None:
            return self._one_shard(rows, targets)
        logits = self.head(rows).float()
        vocab = logits.shape[1]
        lse = torch.logsumexp(logits, dim=1, keepdim=True)
        top = torch.topk(logits, min(self.k, vocab), dim=1)
        picked = logits.gather(1, targets.clamp(0, vocab - 1).unsqueeze(1)) - lse
        known = (targets >= 0) & (targets < vocab)
        packed = self._pack(top.indices, top.values - lse, picked.squeeze(1), known)
        return packed, lse.squeeze(1), vocab

    def _pack(
        self, ids: torch.Tensor, logprobs: torch.Tensor, target: torch.Tensor, known: torch.Tensor
    ) -> torch.Tensor:
        """``[n, 2k + 1]`` float32: the kept ids (integers; -1 padding past them, as int32
        bits), their log-probs (0 padding) and the target's log-prob (NaN where the next token
        is not known)."""
        n, kept = ids.shape
        packed = torch.empty((n, self.width), dtype=torch.float32, device=ids.device)
        pad_indices(packed[:, kept : self.k])
        packed[:, self.k + kept : 2 * self.k] = 0
        packed[:, :kept] = carry_indices(ids)
        packed[:, self.k : self.k + kept] = logprobs
        packed[:, 2 * self.k] = torch.where(known, target, float("nan"))
        return packed

    def _one_shard(
        self, x: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """:meth:`_one` on this rank's vocabulary shard: the shard's top-k (global ids), its
        log-sum-exp and the target's logit where it holds it (``-inf`` elsewhere) go through
        one all-gather, then the merge every rank does alike."""
        shard = self.shard
        local = shard.logits(x)
        n, width = local.shape
        k = min(self.k, width)
        top = torch.topk(local, k, dim=1)
        at = targets - shard.start
        mine = (at >= 0) & (at < width)
        picked = local.gather(1, at.clamp(0, width - 1).unsqueeze(1)).squeeze(1)
        part = torch.cat(
            [
                top.values,
                carry_indices(top.indices + shard.start),  # int32 bits: gathered as they are
                torch.logsumexp(local, dim=1, keepdim=True),
                torch.where(mine, picked, float("-inf")).unsqueeze(1),
            ],
            dim=1,
        )  # [n, 2k + 2]
        every = shard.all_gather(part).view(n, shard.ranks, 2 * k + 2)
        lse = torch.logsumexp(every[:, :, 2 * k], dim=1)
        values = every[:, :, :k].reshape(n, -1)
        ids = carried_indices(every[:, :, k : 2 * k].reshape(n, -1))
        kept = min(self.k, values.shape[1])
        best = torch.topk(values, kept, dim=1)
        best_ids = ids.gather(1, best.indices)
        real = torch.isfinite(best.values)  # a shard of padding offers -inf
        target = every[:, :, 2 * k + 1].max(dim=1).values - lse
        known = (targets >= 0) & (targets < shard.vocab)
        packed = self._pack(
            torch.where(real, best_ids, -1),
            torch.where(real, best.values - lse[:, None], 0.0),
            target,
            known,
        )
        return packed, lse, shard.vocab


def _held(
    unknown: np.ndarray | None, asked: np.ndarray | None, rows: int, targets: torch.Tensor
) -> np.ndarray:
    """Where in an instance's picked rows (``asked`` of the ``rows``, or all) the next token
    is drawn after this read: from the step context's ``unknown`` (host), else from the
    targets on the device (a sync; what callers without a context get)."""
    if unknown is None:
        return torch.nonzero(targets < 0).squeeze(1).cpu().numpy()
    if asked is None:
        return unknown
    return np.flatnonzero(np.isin(asked, unknown))


def lens_bank(readout: Any, instances: Any, k: int, model: Any) -> LensBank:
    """``LensReadout.worker_bank``: the lenses' bank on the model's head (``model``: the
    worker's ``ModelParts``)."""
    from probehook.errors import UnsupportedModelError

    if model.head is None:
        raise UnsupportedModelError(
            "lenses read the model's final norm and unembedding, and this model has none "
            "probehook can call: a final norm of a name it does not know, or, run as a pooling "
            "model (capture_only=True), an untied LM head that is not in a safetensors file of "
            "the checkpoint."
        )
    return LensBank(instances, k, model.head, model.token_logits, model.shard).to(model.device)
