"""Check, in your own CI, that a model trains through poptorchsim as it does
in plain PyTorch: the helpers poptorchsim's own test suite uses.

    from poptorchsim.testing import assert_trains_like_pytorch

    assert_trains_like_pytorch(
        MyModelWithLoss(),                       # forward(*inputs) -> (output, loss)
        lambda params: torch.optim.SGD(params, lr=0.01),
        [batch1, batch2],                        # combined batches, as the model is called
        options=poptorchsim.Options().Training.gradientAccumulation(2))

The reference is plain PyTorch on a deep copy of the model, fed the same
combined batch in PopTorch's layout ``[deviceIterations,
gradientAccumulation, replicationFactor, micro_batch, ...]``: each device
iteration is one optimizer step whose gradient is the mean over the
``ga * rf`` micro-batches' gradients.  ``poptorchsim.testing.zoo`` holds the
table of real-world models (torchvision, transformer, recurrent, GPT, BERT)
the tests and benchmarks share.
"""
import copy

import torch

from .. import Options, trainingModel

RTOL = 1e-5
ATOL = 1e-6


def quiet_options():
    """``Options`` with the compilation progress bar off."""
    return Options().showCompilationProgressBar(False)


def to_layout(t, di, ga, rf):
    """A combined batch reshaped to [di, ga, rf, micro, ...]."""
    if t.shape[0] % (di * ga * rf):
        raise ValueError(f"a combined batch of {t.shape[0]} does not split into "
                         f"{di} x {ga} x {rf} micro-batches")
    return t.reshape(di, ga, rf, t.shape[0] // (di * ga * rf), *t.shape[1:])


def reference_call(model, optimizer, inputs, di=1, ga=1, rf=1):
    """One trainingModel call reproduced in plain PyTorch.

    ``model(*micro_inputs)`` must return ``(output, loss)``.  Returns the
    outputs stacked as ``[di, ga, rf, micro, ...]`` and the losses as
    ``[di, ga, rf]`` (each computed with the weights before that iteration's
    optimizer step)."""
    split = [to_layout(t, di, ga, rf) for t in inputs]
    outs, losses = [], []
    for i in range(di):
        optimizer.zero_grad()
        for g in range(ga):
            for r in range(rf):
                out, loss = model(*[t[i, g, r] for t in split])
                (loss / (ga * rf)).backward()
                outs.append(out.detach().clone())
                losses.append(loss.detach().clone())
        optimizer.step()
    micro_out = outs[0].shape
    return (torch.stack(outs).reshape(di, ga, rf, *micro_out),
            torch.stack(losses).reshape(di, ga, rf))


def reference_train(model, optimizer, batches, di=1, ga=1, rf=1):
    """``reference_call`` over several calls; returns the per-call results."""
    return [reference_call(model, optimizer, b, di, ga, rf) for b in batches]


def assert_state_close(actual_model, expected_model, rtol=RTOL, atol=ATOL):
    """Parameters and buffers of two models match (names and values)."""
    actual = actual_model.state_dict()
    expected = expected_model.state_dict()
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")


def assert_trains_like_pytorch(model, make_optimizer, batches, options=None, rtol=1e-5,
                               atol=1e-6):
    """Trains a deep copy of ``model`` through ``trainingModel`` (under
    ``options``: device iterations, gradient accumulation, replication,
    pipelining as the model's blocks say) on each combined batch of
    ``batches``, and another copy in plain PyTorch as ``reference_call``
    does; asserts the losses and then every parameter and buffer match.
    ``make_optimizer(params)`` builds the optimizer for each copy.  Returns
    the simulator's losses as each call returned them.  Fails if
    the weights did not move, where the comparison would prove nothing."""
    options = options or quiet_options()
    sim, ref, start = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    o = options
    di = o.device_iterations
    ga = o.Training.gradient_accumulation
    rf = o.replication_factor
    wrapped = trainingModel(sim, options, make_optimizer(sim.parameters()))
    reference = make_optimizer(ref.parameters())
    losses = []
    for batch in batches:
        batch = tuple(batch)
        _, loss = wrapped(*batch)
        _, ref_loss = reference_call(ref, reference, batch, di, ga, rf)
        # the output mode decides which losses come back: all, or the last
        # micro-batch's of each replica (Final, training's default)
        expected = ref_loss if loss.numel() == ref_loss.numel() else ref_loss[-1, -1]
        torch.testing.assert_close(loss.reshape(expected.shape), expected, rtol=rtol,
                                   atol=atol, msg=lambda m: f"losses: {m}")
        losses.append(loss)
    wrapped.copyWeightsToHost()
    moved = max(((a - b).abs().max().item() for a, b in
                 zip(sim.parameters(), start.parameters())), default=0.0)
    assert moved > 0, "the weights did not move: the comparison would prove nothing"
    assert_state_close(sim, ref, rtol=rtol, atol=atol)
    return losses
