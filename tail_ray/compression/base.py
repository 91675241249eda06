"""The compressor contract: everything a collective asks of a compressor, with no-op defaults.

Roles follow GRACE: a compressor turns one exchange's gradients into ONE self-describing
payload and back; only the payload travels. Whatever state a compressor keeps (error-feedback
residuals, the bit-width controller) stays local, and decoding never needs it, so any
instance decodes any rank's payload.

A collective (tail_ray.collective) drives a compressor through these calls only, and never
looks inside a payload or a record:

    payload = c.compress(grads)                      # {name: gradient} -> bytes
    ... exchange payloads between ranks ...
    c.aggregate(payloads, grads, own=rank)           # decode, observe, mean into grads
    c.fold_residuals(grads)                          # a step sent uncompressed instead
    c.set_lr(lr)                                     # training signal, once per step
    c.state_dict() / c.load_state_dict(sd, residuals=...)

``grads`` maps parameter names to gradient tensors (views of a DDP bucket: writing them
writes what DDP reads back).

A collective other than all-gather (the sharded reduce-scatter + all-gather, the
hierarchical exchange: tail_ray/collective/sharded.py) needs three more calls, available
where ``shardable`` is True:

    payloads = c.compress_shards(grads, shards, own_shard=k)   # one step, one payload per owner
    c.aggregate(received, {name: flat[slice]}, own=rank)       # the owner: mean of its slices
    c2 = c.second_stage()                                      # re-compresses the owner's mean
    report = c.peer_report(names)                              # what the owner's aggregate measured
    c.observe_reports([(names_j, report_j), ...])              # ... told to the other ranks

A shard is a mapping ``{layer name: slice}`` of element ranges of the flat gradients;
``compress_shards`` runs error feedback and the controller once per layer, on the whole
layer, and cuts what it would have sent into one payload per shard, each layer's slice under
the layer's own name. So a payload of shard k holds exactly the layers of
``{name: flat(grads[name])[s] for name, s in shards[k].items()}``, which is what the owner of
shard k passes as ``into`` to ``aggregate``: ``aggregate`` needs no new semantics, it averages
any number of payloads that each hold exactly the layers of ``into`` at ``into``'s sizes.

Only the owner of a shard sees every rank's version of it, so only its controller can measure
the spread between workers there (Tail's SGD-noise estimate). ``peer_report`` packs what its
latest ``aggregate`` measured (a few numbers per layer, small next to any payload) and the
collective hands it to the other ranks, whose ``observe_reports`` take it in: every rank's
controller then sees every layer's noise, as it would after an all-gather.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tail_ray.compression.aggregate import mean_tensors_into
from tail_ray.compression.stats import LayerStats


class Compressor(ABC):
    """Base of every compressor; subclasses implement ``compress`` and ``decompress``.

    The defaults fit a stateless compressor: ``aggregate`` decodes every payload to tensors
    and averages them; there is nothing to fold, no schedule, nothing to checkpoint.
    """

    name = "compressor"
    # Whether compress_shards / second_stage are implemented (the sharded and the
    # hierarchical collectives need them). A declared capability, never probed by attribute.
    shardable = False

    def __init__(self) -> None:
        self._last_stats: list[LayerStats] = []

    @property
    def last_stats(self) -> list[LayerStats]:
        """Per-layer records of the latest ``compress`` call, in its layer order."""
        return self._last_stats

    @abstractmethod
    def compress(self, grads: Mapping[str, torch.Tensor]) -> bytes:
        """Compress gradients keyed by parameter name into one payload (never writes ``grads``)."""

    @abstractmethod
    def decompress(self, payload: bytes) -> dict[str, torch.Tensor]:
        """Decode any rank's payload to flat fp32 CPU tensors keyed by layer name."""

    def aggregate(
        self, payloads: Sequence[bytes], into: Mapping[str, torch.Tensor], *, own: int | None = None
    ) -> None:
        """Write the mean over ``payloads`` of each layer of ``into`` into it, in place.

        ``payloads[own]`` (when given) is what this compressor's latest ``compress`` returned,
        so a compressor may take it from what it still holds instead of decoding it. Every
        payload must hold every layer of ``into`` at its size; otherwise ``CodecError``, raised
        before anything is written. A compressor with a controller observes the payloads
        here (after decoding, before writing). Payloads are averaged in the order given.
        """
        mean_tensors_into([self.decompress(p) for p in payloads], into)

    # --- sharded collectives (implemented where ``shardable``) --------------------------------
    @property
    def shard_alignment(self) -> int:
        """Elements a slice boundary inside a layer must be a multiple of (a quantizer's bucket,
        so that a slice holds whole buckets and cutting changes nothing that was sent)."""
        return 1

    def compress_shards(
        self,
        grads: Mapping[str, torch.Tensor],
        shards: Sequence[Mapping[str, slice]],
        *,
        own_shard: int | None = None,
    ) -> list[bytes]:
        """One step of compression of every layer of ``grads``, cut into one payload per shard.

        ``shards[k]`` maps layer names to element ranges of their flat gradients (``slice(a, b)``
        with step 1, ``a`` and every inner boundary a multiple of ``shard_alignment``); the
        shards partition the layers' elements. Payload k holds each layer of ``shards[k]``
        restricted to its slice, under the layer's name. Error feedback, the controller and
        ``last_stats`` see each layer once, whole, exactly as ``compress`` would.
        ``own_shard``: the shard this rank will ``aggregate`` itself; its payload then counts
        as what ``compress`` returned for ``aggregate(own=...)``.
        """
        raise NotImplementedError(f"compressor {self.name!r} does not implement compress_shards")

    def peer_report(self, names: Sequence[str]) -> bytes:
        """What the latest ``aggregate`` measured about ``names`` (its ``into`` layers) that the
        ranks which did not see those payloads need (a controller's noise estimate); empty
        by default. Opaque bytes, read only by ``observe_reports`` of the same kind."""
        return b""

    def observe_reports(self, reports: Sequence[tuple[Sequence[str], bytes]]) -> None:
        """Take in other ranks' ``peer_report(names)`` of this step, one per owner; a layer this
        compressor measured itself this step keeps its own measurement. Nothing by default."""
        return None  # a no-op by default

    def second_stage(self) -> Compressor:
        """A compressor for a collective's second stage: the owner of a shard re-compresses the
        MEAN it aggregated. The same codec and settings; its own error feedback (what the
        second stage drops is owed to the mean, not to any one worker's stream); and, where
        there is a controller, an error budget taken relative to the SGD noise of the mean,
        which this compressor's ``aggregate`` measures on the owner's shard."""
        raise NotImplementedError(f"compressor {self.name!r} has no second stage")

    def fold_residuals(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Add what error feedback still owes into ``grads`` (in place) and forget it: called
        for a step the collective sends uncompressed. No error feedback: nothing owed."""
        return None  # a no-op by default

    def set_lr(self, lr: float) -> None:
        """The learning rate of the coming step (a controller may tighten after a drop)."""
        return None  # a no-op by default

    def set_linear_optimizer(self, linear: bool) -> None:
        """Whether the optimizer stepping on the delivered gradients is linear in them (plain
        or momentum SGD); a controller may then loosen its budget (bitwidth/policy.py)."""
        return None  # a no-op by default

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state, keyed by layer name (never by DDP bucket index)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any], *, residuals: bool = True) -> None:
        """Restore ``state_dict()``; ``residuals=False`` (a resized job) starts error feedback
        from zero and keeps everything else."""
        return None  # a no-op by default

    def residuals_of(self, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The error-feedback residuals inside ``state`` (a ``state_dict()`` of this kind of
        compressor, possibly another rank's), flat, keyed by layer name; none by default.
        On a resize the collective sums what every old rank's residuals owed the mean and
        folds it into the new ranks' first gradients (see PayloadHookState.load_resized)."""
        return {}
