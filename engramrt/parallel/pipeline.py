"""A synchronous pipeline over torch.distributed point-to-point messages: transport only.

Rank 0 is the first stage and the driver: it runs a ``StepBatch`` on its stage and sends the
step message (a header of two integers, then the batch's bytes, ``runner.batch``'s codec) and
the ``Carry`` to rank 1, and so on;
the last stage samples and sends the ``StepResult`` back to rank 0. With one stage there are no
messages and the same code runs in one process. What each stage computes is its
``StageRunner``'s business; history rebuilds stay on rank 0, the history's one owner.

Tensors travel as raw bytes, so the hand-off is bit-exact whatever the dtype or backend.

With tensor parallelism a stage is a group of ranks; its leader (TP rank 0) is the stage above,
and it broadcasts each step (the same message, plus the tokens on the first stage) to its
followers, which run the same step on their slices; only the leader samples.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist

from engramrt.runner.batch import (
    DeviceResult,
    StepBatch,
    StepResult,
    decode_batch,
    decode_result,
    encode_batch,
    encode_result,
)
from engramrt.runner.carry import Carry
from engramrt.runner.stage import StageRunner

_STEP, _STOP = 0, 1


class StageLost(RuntimeError):
    """A message to or from another stage failed: that stage's process is gone (killed, or
    ended by its own failure). The transport's message (gloo's or NCCL's, naming a socket)
    goes to the log; the client's error names the stage."""


class Pipeline:
    """``rank`` and ``world``: this process's stage and the number of stages."""

    def __init__(self, runner: StageRunner, rank: int = 0, world: int = 1):
        self.runner, self.rank, self.world = runner, rank, world
        self.vocab = runner.model.cfg.vocab_size
        self.tp = runner.model.tp
        self.lost: str | None = None  # the peer whose connection failed (``StageLost``)

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
        ``StageRunner.keeps_samples``): only with one stage of one rank."""
        return self.world == 1 and self.runner.keeps_samples

    def launch(self, batch: StepBatch) -> DeviceResult:
        """``step`` without waiting for the sampled tokens where the pipeline has one stage;
        with several, the step's messages make it synchronous (overlap scheduling is off)."""
        if self.world == 1 and self.tp.size == 1:
            return self.runner.launch(batch)
        return DeviceResult.ready(self.step(batch))

    def stop(self) -> None:
        """Release the other ranks (their ``serve`` returns); after ``StageLost`` there is
        nobody to release: the launcher takes the rest down."""
        if self.is_driver and self.lost is None:
            self._release()

    def _release(self) -> None:
        """A stop message down the pipeline, and to this stage's TP followers."""
        if not self.is_last:
            self._send_header(_STOP, 0)
        if self.tp.size > 1:
            self._share(_STOP)

    # --- every other rank ----------------------------------------------------------------

    def serve(self) -> None:
        if self.tp.rank != 0:
            self._follow()
            return
        while True:
            kind, size = self._recv_header()
            if kind == _STOP:
                self._release()
                return
            self._stage(self._recv_batch(size))

    def _follow(self) -> None:
        """A TP follower: the leader's steps on this rank's slices, until it says stop."""
        while True:
            kind, size = self._bcast((2,), torch.int64).tolist()
            if kind == _STOP:
                return
            batch = decode_batch(self._bcast((size,), torch.uint8))
            carry = None
            if self.rank != 0:
                like = Carry.empty(self.runner.model, batch.num_tokens)
                carry = Carry(*(self._bcast(t.shape, t.dtype) for t in like.tensors()))
            self.runner.compute(batch, carry, last_only=not batch.full_logits)

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
        with self._link(f"a tensor-parallel rank of pipeline stage {self.rank}"):
            return self.tp.broadcast(buf).view(dtype).view(shape)

    def _share(self, kind: int, batch: StepBatch | None = None, carry: Carry | None = None):
        """The leader's half of ``_follow``."""
        if kind == _STOP:
            self._bcast((2,), torch.int64, torch.tensor([_STOP, 0]))
            return
        message = encode_batch(batch, with_tokens=carry is None)  # the first stage embeds
        self._bcast((2,), torch.int64, torch.tensor([_STEP, len(message)]))
        self._bcast((len(message),), torch.uint8, message)
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

    @contextlib.contextmanager
    def _link(self, peer: str) -> Iterator[None]:
        """A transport error while talking to ``peer`` is ``StageLost``, named for it."""
        try:
            yield
        except RuntimeError as exc:
            self.lost = peer
            print(f"engramrt: stage {self.rank}: {peer}: {exc}", file=sys.stderr, flush=True)
            raise StageLost(
                f"{peer} is gone: the connection to it failed (its process died or was "
                "killed; the server's log has the transport's error)"
            ) from None

    def _send(self, t: torch.Tensor, dst: int) -> None:
        with self._link(f"pipeline stage {dst // self.tp.size}"):
            dist.send(t.contiguous().view(torch.uint8).flatten().to(self._dev()), dst)

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self._dev())
        with self._link(f"pipeline stage {src // self.tp.size}"):
            dist.recv(buf, src)
        return buf.to(self.runner.device).view(dtype).view(shape)

    def _send_values(self, values: list, dtype: torch.dtype, dst: int) -> None:
        self._send(torch.tensor(values, dtype=dtype), dst)

    def _send_header(self, kind: int, size: int) -> None:
        self._send_values([kind, size], torch.int64, self._peer(self.rank + 1))

    def _recv_header(self) -> tuple[int, int]:
        kind, size = self._recv((2,), torch.int64, self._peer(self.rank - 1)).tolist()
        return kind, size

    def _send_batch(self, batch: StepBatch) -> None:
        message = encode_batch(batch, with_tokens=False)
        self._send_header(_STEP, len(message))
        self._send(message, self._peer(self.rank + 1))

    def _recv_batch(self, size: int) -> StepBatch:
        return decode_batch(self._recv((size,), torch.uint8, self._peer(self.rank - 1)))

    def _recv_carry(self, t: int) -> Carry:
        src, like = self._peer(self.rank - 1), Carry.empty(self.runner.model, 0)
        return Carry(*(self._recv((t, *x.shape[1:]), x.dtype, src) for x in like.tensors()))

    def _send_result(self, result: StepResult) -> None:
        message = encode_result(result)
        self._send_values([len(message)], torch.int64, 0)
        self._send(message, 0)
        if result.logits is not None:
            self._send(result.logits.float(), 0)

    def _recv_result(self, batch: StepBatch) -> StepResult:
        last = self._peer(self.world - 1)
        size = int(self._recv((1,), torch.int64, last).item())
        result = decode_result(self._recv((size,), torch.uint8, last))
        if batch.return_logits:
            result.logits = self._recv((batch.num_tokens, self.vocab), torch.float32, last)
        return result
