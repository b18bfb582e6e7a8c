"""A stand-in for torchvision in the vLLM lane (put this folder on PYTHONPATH; Python imports it at start-up in
every process, vLLM's engine child included). torchvision has no build for the lane's CPU torch (PyPI's is a CUDA
build whose operators fail to register), but transformers' Qwen2-VL processor insists on a video processor, which
needs it, and vLLM's Qwen2-VL module imports a torchvision-only transformers module. Images alone need neither: this
gives the processor a video processor that refuses videos, and serves that module from transformers' PIL image
processor. GPU installs have torchvision and never load this."""

from __future__ import annotations

import importlib
import sys
import types


def _install() -> None:
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return
    import transformers
    from transformers import processing_utils
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil
    from transformers.video_processing_utils import BaseVideoProcessor, VideoProcessorMixin

    class NoVideoProcessor(VideoProcessorMixin):
        def __init__(self, **kwargs: object) -> None:
            super().__init__()
            self.merge_size = kwargs.get("merge_size", 2)
            self.patch_size = kwargs.get("patch_size", 14)
            self.temporal_patch_size = kwargs.get("temporal_patch_size", 2)

        def preprocess(self, videos: object, **kwargs: object) -> None:
            raise NotImplementedError("videos need torchvision")

    class NoVideoAutoProcessor:
        @classmethod
        def from_pretrained(cls, path: str, *args: object, **kwargs: object) -> NoVideoProcessor:
            try:
                config, _ = BaseVideoProcessor.get_video_processor_dict(path, **kwargs)
            except Exception:  # noqa: BLE001 - no video config saved: the defaults
                config = {}
            return NoVideoProcessor(**config)

    # the processor checks its video processor's class against these, which the lazy module hides without torchvision
    transformers.VideoProcessorMixin = VideoProcessorMixin
    processing_utils.transformers_module.VideoProcessorMixin = VideoProcessorMixin
    importlib.import_module("transformers.models.auto.video_processing_auto").AutoVideoProcessor = NoVideoAutoProcessor
    stub = types.ModuleType("transformers.models.qwen2_vl.image_processing_qwen2_vl")
    stub.smart_resize = pil.smart_resize
    stub.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
    stub.Qwen2VLImageProcessorKwargs = pil.Qwen2VLImageProcessorKwargs
    sys.modules[stub.__name__] = stub


try:
    _install()
except ImportError:  # not a venv with transformers: nothing to stand in for
    pass
