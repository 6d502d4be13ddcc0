"""The ``cuda_graphs`` part (off by default): each decoder layer's forward, whichever it is (residual_joins.py's
or the class's), runs through layer_graphs.py, which replays the layer's training forward and backward as
captured CUDA graphs. The layers of one model share one ``layer_graphs.GraphState``."""

from __future__ import annotations

from tigon.patching import layer_graphs
from tigon.patching.instance_methods import InstanceMethod, Recipe, class_forward
from tigon.patching.layer_forward import LayerForward
from tigon.patching.parts import Part
from tigon.patching.patch_handle import SetAttr
from tigon.patching.sites import own_forward, sites


class GraphLayer:
    """The cuda_graphs switch on one decoder layer: its forward when the patch is applied (residual_joins.py's,
    or the class's) runs through a layer_graphs.LayerGraphs; undo puts that forward back."""

    def __init__(self, layer, state):
        self.layer, self.state = layer, state

    def apply(self):
        layer = self.layer
        inner = own_forward(layer) or InstanceMethod(layer, Recipe(class_forward, (type(layer),)))
        runner = layer_graphs.LayerGraphs(layer, self.state)
        self.set = SetAttr(layer, "forward", LayerForward(layer, inner, checkpoint=False, graphs=runner))
        self.set.apply()

    def blocked(self, state):
        return self.set.blocked(state)

    def undo(self):
        self.set.undo()


def graphs_line(classes):
    return f"{classes.decoder_layer.__name__} -> forward and backward replayed as CUDA graphs in training (cuda_graphs)"


def plan_graphs(plan, root, family, classes, switches=None):
    """Every decoder layer of the model, sharing one layer_graphs.GraphState."""
    state = layer_graphs.GraphState(root)
    for layer, _, _ in sites(root, classes.decoder_layer):
        own = own_forward(layer)
        if isinstance(own, LayerForward) and own.graphs is not None:
            continue
        plan.add(GraphLayer(layer, state), graphs_line(classes))


GRAPHS = Part("cuda_graphs", lambda f, c: c.decoder_layer is not None, plan_graphs, lambda f, c, s: [graphs_line(c)])
