"""The front end: the spec (``spec.py``: OmegaConf -> pydantic), the model.py contract
(``model_file.py``: the one loader of a model file) and capture (``capture.py``:
torch.export -> a flat-calling torch.fx GraphModule)."""
