"""The user's model reads the trained weights when the device holds them
apart (a CUDA host device, ``machine/host_device.py``): copied back when the
model is read, not after every call, as PopTorch does.

After a training call the device's weights are newer than the model's.
PopTorch then copies them back when the model is read: it gives the model
a subclass of its class whose attribute reads call
``copyWeightsToHostIfNeeded()``.  Here every module of the model gets one
(its parameters, buffers, ``forward`` and ``state_dict`` reads copy first),
so ``model.fc.weight`` reads trained values as ``model.state_dict()`` does.
A tensor taken from the model before the call is the model's own tensor and
is updated in place by the copy, once the model is read or
``copyWeightsToHost()`` is called.  The subclasses pickle and copy as the
module's own class, and ``destroy()`` (``remove``) puts the classes back.
"""
import weakref

import torch

_READS = frozenset({"_parameters", "_buffers", "forward", "state_dict"})
_CLASSES = {}           # the module's class -> its reading subclass


def _copy_if_needed(module):
    owner = object.__getattribute__(module, "__dict__").get("_poptorchsim_reader")
    executor = owner() if owner is not None else None
    if executor is not None:
        executor.copyWeightsToHostIfNeeded()


def _new_instance(cls):
    """An empty module of ``cls`` for unpickling (its state is set after)."""
    return cls.__new__(cls)


def _reading_class(cls):
    """The subclass of ``cls`` whose reads copy the weights back first."""
    if cls not in _CLASSES:
        def __getattribute__(self, name):
            if name in _READS:
                _copy_if_needed(self)
            return cls.__getattribute__(self, name)

        def __getattr__(self, name):       # parameters, buffers (nn.Module's __getattr__)
            value = cls.__getattr__(self, name)
            if isinstance(value, torch.Tensor):
                _copy_if_needed(self)
            return value

        def __reduce_ex__(self, protocol):
            # pickled and copied as the module's own class, with trained weights
            _copy_if_needed(self)
            object.__setattr__(self, "__class__", cls)
            try:
                reduced = list(cls.__reduce_ex__(self, protocol))
            finally:
                object.__setattr__(self, "__class__", _CLASSES[cls])
            reduced[:2] = [_new_instance, (cls,)]
            if len(reduced) > 2 and isinstance(reduced[2], dict):
                reduced[2] = {k: v for k, v in reduced[2].items()
                              if k != "_poptorchsim_reader"}
            return tuple(reduced)

        _CLASSES[cls] = type(cls.__name__, (cls,), {
            "__getattribute__": __getattribute__, "__getattr__": __getattr__,
            "__reduce_ex__": __reduce_ex__, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "_poptorchsim_reads_lazily": True})
    return _CLASSES[cls]


def install(model, executor):
    """Every module of ``model`` reads its weights through ``executor``'s
    ``copyWeightsToHostIfNeeded()``."""
    ref = weakref.ref(executor)
    for module in model.modules():
        module.__dict__["_poptorchsim_reader"] = ref
        cls = type(module)
        if not getattr(cls, "_poptorchsim_reads_lazily", False):
            object.__setattr__(module, "__class__", _reading_class(cls))


def remove(model):
    """Puts back the modules' own classes (the executor's ``destroy()``)."""
    for module in model.modules():
        module.__dict__.pop("_poptorchsim_reader", None)
        cls = type(module)
        if getattr(cls, "_poptorchsim_reads_lazily", False):
            object.__setattr__(module, "__class__", cls.__bases__[0])
