"""``deepseek_v3_grouped.py`` with its router's correction bias pushing every token into
group 0 (experts 0 and 1): at ep2 ep rank 1's experts receive no rows at all (an empty
all-to-all each way, zero gradients) while ep rank 0's receive every row: uneven routing
at its extreme."""
import torch

from deepseek_v3_grouped import VOCAB, example_inputs  # noqa: F401 (the CLI reads it here)
from deepseek_v3_grouped import build_model as _grouped


def build_model():
    model = _grouped()
    with torch.no_grad():  # sigmoid scores lie in (0, 1): +1 on group 0 always wins it
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.tensor([1.0, 1.0, -1.0, -1.0]))
    return model
