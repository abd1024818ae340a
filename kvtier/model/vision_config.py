"""The vision side of a vision-language checkpoint, as model/config.py reads it (model/llava.py runs it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """A LLaVA checkpoint's vision side (model/llava.py): a CLIP tower, the projector and where
    its features go. An image is ``image_size`` square; it becomes :attr:`num_image_tokens`
    placeholder tokens ``image_token_id`` in the prompt, each replaced by one projected feature."""

    architecture: str  # the checkpoint's, e.g. LlavaForConditionalGeneration
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    image_token_id: int = 32000
    feature_layers: tuple[int, ...] = (-2,)  # hidden states (0: the embeddings) concatenated as features
    select_strategy: str = "default"  # "default": the CLS position is dropped; "full": kept
    projector_act: str = "gelu"
    projector_bias: bool = True

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens per image: one per patch, and the CLS position with "full"."""
        return self.num_patches + (self.select_strategy == "full")

    @property
    def num_layers_run(self) -> int:
        """Tower layers the selected hidden states need (the ones after them are never run)."""
        return max(i if i >= 0 else self.num_layers + 1 + i for i in self.feature_layers)
