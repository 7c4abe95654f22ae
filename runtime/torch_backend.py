"""The PyTorch reference backend: the export's own graph modules, run eagerly.

`dspark.export` wraps the models in flat-I/O modules (`TargetGraph`, `StaticCacheTargetGraph`,
`BackboneGraph`, `HeadStepGraph`, `HeadGreedyGraph`) and describes their feeds in
`export.contract`. This backend runs exactly those modules on the same named feeds, so the
runtime cannot tell it from an exported engine except by speed — which makes it the yardstick
the ONNX Runtime (and later TensorRT) backends are tested against.

`device="cuda"` runs the modules on a GPU (moved there at `open()`): feeds go to the device and
outputs come back to the host on every call, so the slot caches stay host numpy arrays and cross
the bus each step. That path is correct but not fast; device-resident KV is still to do. It has
not run on a GPU yet (tests/test_gpu_engine.py runs it wherever CUDA exists).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from dspark.export import contract as C
from dspark.export.drafter_graphs import BackboneGraph, HeadGreedyGraph, HeadStepGraph
from dspark.export.target_graph import StaticCacheTargetGraph, TargetGraph
from dspark.models import DSparkDrafter, TargetModel

from .backend import Array, Backend, BackendUnavailable, as_torch

DEFAULT_PLACEMENT = C.Placement(lm_head_in_backbone=True)


def graph_modules(
    target: TargetModel, drafter: DSparkDrafter, placement: C.Placement = DEFAULT_PLACEMENT
) -> dict[str, tuple[C.GraphSpec, nn.Module]]:
    tc, dc = target.config, drafter.config
    graphs = {
        C.TARGET: (C.target_spec(tc, dc.context_feature_size, "float32"), TargetGraph(target)),
        C.TARGET_STATIC: (C.target_static_spec(tc, dc.context_feature_size, "float32"),
                          StaticCacheTargetGraph(target)),
        C.BACKBONE: (C.backbone_spec(dc, placement, "float32"), BackboneGraph(drafter, placement)),
    }
    if C.has_head_graphs(dc):
        graphs[C.HEAD_STEP] = (C.head_step_spec(dc, placement, "float32"), HeadStepGraph(drafter, placement))
        graphs[C.HEAD_GREEDY] = (C.head_greedy_spec(dc, placement, "float32"),
                                 HeadGreedyGraph(drafter, placement))
    return graphs


class TorchBackend(Backend):
    """Runs the PyTorch models through the export's graph wrappers (float32, on `device`)."""

    def __init__(self, target: TargetModel, drafter: DSparkDrafter,
                 placement: C.Placement = DEFAULT_PLACEMENT, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.target, self.drafter, self.placement = target.eval(), drafter.eval(), placement
        self.device = torch.device(device)
        self._graphs = graph_modules(target, drafter, placement)
        self._specs = {name: spec for name, (spec, _) in self._graphs.items()}

    @property
    def specs(self) -> dict[str, C.GraphSpec]:
        return self._specs

    def _open(self) -> None:
        """The models arrive loaded; on a GPU they move to it here."""
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise BackendUnavailable(f"TorchBackend(device='{self.device}'): this torch ({torch.__version__}) "
                                         "sees no CUDA device; use device='cpu' or a CUDA build of torch")
            self.target.to(self.device)
            self.drafter.to(self.device)

    def _close(self) -> None:
        """The caller owns the models: nothing to release."""

    @torch.no_grad()
    def _run(self, graph: str, feeds: Mapping[str, Array]) -> dict[str, Array]:
        spec, module = self._graphs[graph]
        outputs = module(*(as_torch(feeds[name]).to(self.device) for name in spec.input_names))
        if self.device.type != "cpu":  # the runtime's buffers are host arrays
            outputs = [o.cpu() for o in outputs]
        return dict(zip(spec.output_names, outputs, strict=True))
