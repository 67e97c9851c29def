"""Whether a model is being built on the meta device, where model/size.py counts it (a leaf module: the model's
modules import it, and model/size.py imports them)."""
import torch


def counting() -> bool:
    """Whether a model is being built on the meta device to be counted: a constructor that precomputes a table by a
    Python loop sized by an option (ALiBi's slopes per head, Performer's random-feature blocks) makes only its
    shape then, so a count never waits on a size it is about to refuse."""
    return torch.get_default_device().type == "meta"
