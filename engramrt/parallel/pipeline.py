"""A synchronous pipeline over torch.distributed point-to-point messages: transport only.

Rank 0 is the first stage and the driver: it runs a ``StepBatch`` on its stage and sends the
step message (the batch's integers and sampling rows) and the ``Carry`` to rank 1, and so on;
the last stage samples and sends the ``StepResult`` back to rank 0. With one stage there are no
messages and the same code runs in one process. What each stage computes is its
``StageRunner``'s business; history rebuilds stay on rank 0, the history's one owner.

Tensors travel as raw bytes, so the hand-off is bit-exact whatever the dtype or backend.

With tensor parallelism a stage is a group of ranks; its leader (TP rank 0) is the stage above,
and it broadcasts each step (the same message, plus the tokens on the first stage) to its
followers, which run the same step on their slices; only the leader samples.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from engramrt.runner.batch import PendingResult, SampleRow, StepBatch, StepResult
from engramrt.runner.carry import Carry
from engramrt.runner.logit_controls import Controls
from engramrt.runner.stage import StageRunner

_STEP, _STOP = 0, 1
_INTS, _FLOATS = 5, 3  # a sampling row's parts (``SampleRow.ints``, ``SampleRow.floats``)


def encode_batch(b: StepBatch) -> list[int]:
    """The integers later stages need (not the tokens, not the rebuilds: those stay on the
    first stage; the last stage's logit controls as JSON bytes); ``encode_step`` adds the
    sampling rows (and a first-stage follower's tokens)."""
    tables, targets = b.new_blocks, b.targets
    head = [int(b.return_logits), len(b.slots), int(tables is not None)]
    head += [int(targets is not None), b.target_k, int(b.drafts is not None)]
    body = [*b.slots, *b.run_lens, *b.start_pos, *(b.drafts or [])]
    if tables is not None:
        body += b.block_starts or [0] * len(tables)
        body += [len(t) for t in tables] + [x for t in tables for x in t]
    if targets is not None:
        body += targets
    controls = [[s, c and c.encode(), p, o] for s, c, p, o in b.controls]
    blob = json.dumps([controls, b.masks]).encode()
    body += [len(blob), *blob]  # rare (admissions): bytes as integers is simple enough
    return head + body


def encode_step(b: StepBatch, with_tokens: bool) -> tuple[int, list[int]]:
    """A step as one message (one send, one host sync on the other side): the batch's integers,
    its sampling rows (floats as their int64 bits) and, for a TP follower of the first stage,
    the tokens; with where the batch's integers end."""
    body, rows = encode_batch(b), b.rows()
    floats = torch.tensor([r.floats() for r in rows], dtype=torch.float64).view(torch.int64)
    message = body + [x for r in rows for x in r.ints()] + floats.flatten().tolist()
    return len(body), message + (b.tokens if with_tokens else [])


def decode_step(message: list[int], n: int, with_tokens: bool) -> StepBatch:
    batch = decode_batch(message[:n])
    b, v = len(batch.slots), message[n:]
    ints = [v[i : i + _INTS] for i in range(0, b * _INTS, _INTS)]
    bits = torch.tensor(v[b * _INTS : b * (_INTS + _FLOATS)], dtype=torch.int64)
    floats = bits.view(torch.float64).view(b, _FLOATS).tolist()
    batch.sampling = [SampleRow.from_parts(f, i) for f, i in zip(floats, ints, strict=True)]
    if with_tokens:
        batch.tokens = v[b * (_INTS + _FLOATS) :]
    return batch


def decode_batch(v: list[int]) -> StepBatch:
    ret, n, has_tables, has_targets, target_k, has_drafts = v[:6]
    v = v[6:]
    slots, lens, pos, v = v[:n], v[n : 2 * n], v[2 * n : 3 * n], v[3 * n :]
    drafts, v = (v[:n], v[n:]) if has_drafts else (None, v)
    tables = starts = None
    if has_tables:
        starts, sizes, v, tables = v[:n], v[n : 2 * n], v[2 * n :], []
        for size in sizes:
            tables.append(v[:size])
            v = v[size:]
    targets, v = (v[: sum(lens)], v[sum(lens) :]) if has_targets else (None, v)
    blob, masks = json.loads(bytes(v[1 : 1 + v[0]]).decode())
    controls = [(s, c and Controls.decode(c), p, o) for s, c, p, o in blob]
    masks = [(row, words) for row, words in masks]
    return StepBatch(None, slots, lens, pos, tables, starts, None, bool(ret), targets, target_k,
                     controls=controls, masks=masks, drafts=drafts)  # fmt: skip


class Pipeline:
    """``rank`` and ``world``: this process's stage and the number of stages."""

    def __init__(self, runner: StageRunner, rank: int = 0, world: int = 1):
        self.runner, self.rank, self.world = runner, rank, world
        self.vocab = runner.model.cfg.vocab_size
        self.tp = runner.model.tp

    @property
    def is_last(self) -> bool:
        return self.rank == self.world - 1

    @property
    def is_driver(self) -> bool:
        """Rank 0 of the whole job: the first stage's leader, where the engine runs."""
        return self.rank == 0 and self.tp.rank == 0

    def _peer(self, stage: int) -> int:
        """The global rank of ``stage``'s leader."""
        return stage * self.tp.size

    # --- the driver (rank 0) -------------------------------------------------------------

    def step(self, batch: StepBatch) -> StepResult:
        if not self.is_driver:
            raise RuntimeError("only rank 0 drives the pipeline")
        result = self._stage(batch)  # the first stage's runner checks the batch
        return result if result is not None else self._recv_result(batch)

    @property
    def can_overlap(self) -> bool:
        """Whether a step's tokens may stay on the device for the next one (``launch``, and
        ``PENDING`` tokens): only with one stage of one rank, which samples where it hashes."""
        return self.world == 1 and self.tp.size == 1 and self.runner.last_token is not None

    def launch(self, batch: StepBatch) -> PendingResult:
        """``step`` without waiting for the sampled tokens where the pipeline has one stage;
        with several, the step's messages make it synchronous (overlap scheduling is off)."""
        if self.world == 1 and self.tp.size == 1:
            return self.runner.launch(batch)
        return PendingResult.ready(self.step(batch))

    def stop(self) -> None:
        """Release the other ranks (their ``serve`` returns)."""
        if self.is_driver:
            self._release()

    def _release(self) -> None:
        """A stop message down the pipeline, and to this stage's TP followers."""
        if not self.is_last:
            self._send_header(_STOP, 0, 0)
        if self.tp.size > 1:
            self._share(_STOP)

    # --- every other rank ----------------------------------------------------------------

    def serve(self) -> None:
        if self.tp.rank != 0:
            self._follow()
            return
        while True:
            kind, n, size = self._recv_header()
            if kind == _STOP:
                self._release()
                return
            self._stage(self._recv_batch(n, size))

    def _follow(self) -> None:
        """A TP follower: the leader's steps on this rank's slices, until it says stop."""
        while True:
            kind, n, size = self._bcast((3,), torch.int64).tolist()
            if kind == _STOP:
                return
            batch = decode_step(self._bcast((size,), torch.int64).tolist(), n, self.rank == 0)
            carry = None
            if self.rank != 0:
                like = Carry.empty(self.runner.model, batch.num_tokens)
                carry = Carry(*(self._bcast(t.shape, t.dtype) for t in like.tensors()))
            self.runner.step(batch, carry, last_only=not batch.full_logits)

    # --- one stage of one step -----------------------------------------------------------

    def _stage(self, batch: StepBatch) -> StepResult | None:
        carry = None if self.rank == 0 else self._recv_carry(batch.num_tokens)
        if self.tp.size > 1:
            self._share(_STEP, batch, carry)
        out = self.runner.run(batch, carry)
        if not self.is_last:
            self._send_batch(batch)
            for t in out.tensors():
                self._send(t, self._peer(self.rank + 1))
            return None
        if self.rank != 0:
            self._send_result(out)
            return None
        return out

    # --- the stage's TP group --------------------------------------------------------------

    def _bcast(self, shape, dtype: torch.dtype, value: torch.Tensor | None = None):
        """The leader's ``value`` (raw bytes, on the stage's device) on every rank of the
        group."""
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        if value is None:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.runner.device)
        else:
            buf = value.contiguous().view(torch.uint8).flatten().to(self.runner.device)
        return self.tp.broadcast(buf).view(dtype).view(shape)

    def _share(self, kind: int, batch: StepBatch | None = None, carry: Carry | None = None):
        """The leader's half of ``_follow``."""
        if kind == _STOP:
            self._bcast((3,), torch.int64, torch.tensor([_STOP, 0, 0]))
            return
        n, message = encode_step(batch, carry is None)
        self._bcast((3,), torch.int64, torch.tensor([_STEP, n, len(message)]))
        self._bcast((len(message),), torch.int64, torch.tensor(message))
        if carry is not None:
            for t in carry.tensors():
                self._bcast(t.shape, t.dtype, t)

    # --- messages ------------------------------------------------------------------------

    def _dev(self) -> torch.device:
        """Where messages live: host memory for gloo (also with CUDA stages), else the stage's
        device."""
        if self.world > 1 and dist.get_backend() == "gloo":
            return torch.device("cpu")
        return self.runner.device

    def _send(self, t: torch.Tensor, dst: int) -> None:
        dist.send(t.contiguous().view(torch.uint8).flatten().to(self._dev()), dst)

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self._dev())
        dist.recv(buf, src)
        return buf.to(self.runner.device).view(dtype).view(shape)

    def _send_values(self, values: list, dtype: torch.dtype, dst: int) -> None:
        self._send(torch.tensor(values, dtype=dtype), dst)

    def _send_header(self, kind: int, n: int, size: int) -> None:
        self._send_values([kind, n, size], torch.int64, self._peer(self.rank + 1))

    def _recv_header(self) -> tuple[int, int, int]:
        kind, n, size = self._recv((3,), torch.int64, self._peer(self.rank - 1)).tolist()
        return kind, n, size

    def _send_batch(self, batch: StepBatch) -> None:
        n, message = encode_step(batch, False)
        self._send_header(_STEP, n, len(message))
        self._send_values(message, torch.int64, self._peer(self.rank + 1))

    def _recv_batch(self, n: int, size: int) -> StepBatch:
        message = self._recv((size,), torch.int64, self._peer(self.rank - 1)).tolist()
        return decode_step(message, n, False)

    def _recv_carry(self, t: int) -> Carry:
        src, like = self._peer(self.rank - 1), Carry.empty(self.runner.model, 0)
        return Carry(*(self._recv((t, *x.shape[1:]), x.dtype, src) for x in like.tensors()))

    def _send_result(self, result: StepResult) -> None:
        send = self._send_values
        send(result.tokens, torch.int64, 0)
        if result.logprobs is not None:
            send(result.logprobs, torch.float32, 0)
            send(result.top_ids, torch.int64, 0)
            send(result.top_logprobs, torch.float32, 0)
        if result.target_logprobs is not None:
            send(result.target_logprobs, torch.float32, 0)
            send(result.target_top_ids, torch.int64, 0)
            send(result.target_top_logprobs, torch.float32, 0)
        if result.logits is not None:
            self._send(result.logits.float(), 0)

    def _recv_result(self, batch: StepBatch) -> StepResult:
        last, b, t = self._peer(self.world - 1), batch.num_samples, batch.num_tokens

        def recv(shape, dtype):
            return self._recv(shape, dtype, last).tolist()

        result = StepResult(recv((b,), torch.int64))
        k = batch.logprobs_k
        if k is not None:
            result.logprobs = recv((b,), torch.float32)
            result.top_ids = recv((b, k), torch.int64)
            result.top_logprobs = recv((b, k), torch.float32)
        if batch.targets is not None:
            result.target_logprobs = recv((t,), torch.float32)
            result.target_top_ids = recv((t, batch.target_k), torch.int64)
            result.target_top_logprobs = recv((t, batch.target_k), torch.float32)
        if batch.return_logits:
            result.logits = self._recv((t, self.vocab), torch.float32, last)
        return result
