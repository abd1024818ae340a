"""A step's inputs, as the host builds them and as the forward reads them on the device.

:class:`HostInputs` is what ``ModelRunner.build_inputs`` (engine/runner.py) makes from a
``SchedulerOutput`` and what every tensor-parallel rank uploads alike (engine/tp sends it);
:class:`StepInputs` is the same after the upload, read by the target forward, the sampling and
the MTP block's passes (engine/spec.py)::

    ids          = [ r0 chunk ........ | r1 decode | r2 last, d1, d2 ]    (d: drafts, engine/verify.py)
    positions    = [ c0 .. c0+n0-1     | c1        | c2 .. c2+2      ]    c = num_computed
    sample_rows  = the last row of each request whose chunk reaches its end
    pending_at   = places in ids of tokens the step in flight samples (overlap scheduling) ...
    pending_rows = ... and their rows in that step's tokens
    images       = the parts of images the chunks cover: features for those rows (ImageSpan)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtier.model.attention import AttentionMetadata
from kvtier.model.images import MMInput


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """Part of an image a step computes: its features ``first..last-1`` replace the embeddings
    of the step's rows ``row..row + last - first - 1`` (a prefill chunk may cut an image)."""

    image: MMInput
    first: int
    last: int
    row: int


@dataclass(slots=True)
class HostInputs:
    """A step's inputs as the host builds them: the flattened token ids and positions, per
    request its query and sequence lengths and block table, the rows that sample, and the places
    of tokens still on the device with their rows in the last step's tokens."""

    ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    sample_rows: list[int]
    pending_at: list[int]
    pending_rows: list[int]
    group_tables: list[list[list[int]]] = field(default_factory=list)  # per sliding group with slots: its tables
    images: list[ImageSpan] = field(default_factory=list)  # vision-language models: features to place


@dataclass(slots=True)
class StepInputs:
    """A step's inputs on the device (the pending tokens already in ``input_ids``)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows_cpu: list[int]
    sample_rows: torch.Tensor  # the same, on the device
