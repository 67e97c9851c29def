"""Importing the libraries a run needs, without Python's cyclic garbage collector walking them.

torch, Lightning (which pulls in torch._dynamo, torchmetrics and scipy.signal) and wandb build hundreds of
thousands of Python objects that live as long as the process. While they import, each full collection the
collector starts walks every one of them again, so the collector, not the imports, takes a large share of the
start-up (`python -m blocklab.bench startup` times the imports with the collector off and on)."""
import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def uncollected_imports(*modules: str) -> Iterator[None]:
    """Run the block with the cyclic collector off, then freeze every object alive (gc.freeze) and turn it back
    on: later collections skip the imported modules, which they could never free anyway. Reference counting
    still frees everything else at once; only cycles made inside the block outlive it.

    Nothing changes when all of `modules` are imported already (a later job in the same process): a freeze then
    would keep the last job's uncollected cycles for good. Inside another such block, the outer one decides."""
    if not gc.isenabled() or all(name in sys.modules for name in modules):
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
