"""The PyTorch reference backend: the export's own graph modules, run eagerly (or replayed as CUDA graphs).

`dspark.export` wraps the models in flat-I/O modules (`TargetGraph`, `StaticCacheTargetGraph`,
`BackboneGraph`, `HeadStepGraph`, `HeadGreedyGraph`) and describes their feeds in
`export.contract`. This backend runs exactly those modules on the same named feeds, so the
runtime cannot tell it from an exported engine except by speed — which makes it the yardstick
the ONNX Runtime (and later TensorRT) backends are tested against.

`device="cuda"` runs the modules on a GPU (moved there at `open()`) and keeps the target's keys and
values there: `kv_device` tells the engine to hold its slot caches (the target's and the drafter's)
as device tensors, the graphs take them as they are and their new keys/values stay on the device,
so no cache crosses the bus. The target's logits stay there too (a prefill brings back its last
positions only; a tree's greedy rows are accepted on the device). Every other output (features,
the drafter's block outputs) comes back to the host, where the scheduler reads it.
Recurring feed layouts replay as CUDA graphs (`cuda_graphs.py`; `cuda_graphs=False` runs eagerly):
with the cache on the device, the static-cache target graph has one layout per (requests, tokens),
which is why a device-resident engine verifies through it by default.
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
from .cuda_graphs import GraphCache

DEFAULT_PLACEMENT = C.Placement(lm_head_in_backbone=True)
# on a device, the outputs that stay there: the target graphs' and the drafter backbone's new keys/values
# (into the slot caches) and the target's logits (the runner brings back the rows it needs; tree
# verification takes their argmax on the device)
_DEVICE_OUTPUTS = {C.TARGET: ("present.", "logits"), C.TARGET_STATIC: ("new.", "logits"),
                   C.BACKBONE: ("present_context.",)}
_CACHE_INPUTS = ("cache.", "past_key_values.")  # slot-cache rows: a captured graph reads them where they are


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
                 placement: C.Placement = DEFAULT_PLACEMENT, device: str | torch.device = "cpu",
                 resident_kv: bool = True, cuda_graphs: bool = True) -> None:
        super().__init__()
        self.target, self.drafter, self.placement = target.eval(), drafter.eval(), placement
        self.device = torch.device(device)
        self.resident_kv = resident_kv  # False: every output returns to the host (the cache crosses the bus)
        self.cuda_graphs = cuda_graphs  # on a GPU: replay recurring feed layouts as CUDA graphs (cuda_graphs.py)
        self.graph_cache: GraphCache | None = None
        self._graphs = graph_modules(target, drafter, placement)
        self._specs = {name: spec for name, (spec, _) in self._graphs.items()}

    @property
    def specs(self) -> dict[str, C.GraphSpec]:
        return self._specs

    @property
    def kv_device(self) -> torch.device | None:
        return self.device if self.device.type != "cpu" and self.resident_kv else None

    def _open(self) -> None:
        """The models arrive loaded; on a GPU they move to it here."""
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise BackendUnavailable(f"TorchBackend(device='{self.device}'): this torch ({torch.__version__}) "
                                         "sees no CUDA device; use device='cpu' or a CUDA build of torch")
            self.target.to(self.device)
            self.drafter.to(self.device)
            if self.cuda_graphs:
                self.graph_cache = GraphCache(self.device)

    def _close(self) -> None:
        """The caller owns the models; the captured graphs (and their memory pool) go."""
        self.graph_cache = None

    @torch.no_grad()
    def _run(self, graph: str, feeds: Mapping[str, Array]) -> dict[str, Array]:
        spec, module = self._graphs[graph]
        inputs = [feeds[name] for name in spec.input_names]
        if self.graph_cache is not None:
            outputs = self.graph_cache.run(graph, module, inputs,
                                           [name.startswith(_CACHE_INPUTS) for name in spec.input_names])
        else:
            outputs = module(*(as_torch(f).to(self.device) for f in inputs))
            if self.device.type == "cpu":
                return dict(zip(spec.output_names, outputs, strict=True))
        # the cache's new keys/values and the logits stay on the device; the rest comes back as host copies
        # (never views of a captured graph's buffers, which its next replay overwrites)
        stays = _DEVICE_OUTPUTS.get(graph, ()) if self.kv_device is not None else ()
        return {name: o if name.startswith(stays) else o.to("cpu", copy=True)
                for name, o in zip(spec.output_names, outputs, strict=True)}
