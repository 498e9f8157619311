"""The wrapped model's ``training`` flag, as PopTorch keeps it: PopTorch
wraps a shallow copy of the model, whose own flag stays as it was when
wrapped, while the submodules are the model's own.  So the user guide's
``trainingModel(model)``, then ``model.eval()``, then
``inferenceModel(model)`` trains with its loss (the copy is still in
training mode) and validates without it; the layers inside follow the
model's last ``eval()``/``train()``."""
import torch

import poptorchsim as poptorch


class _WithLoss(torch.nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.drop = torch.nn.Dropout(p)
        self.loss = torch.nn.MSELoss()

    def forward(self, x, target=None):
        out = self.drop(self.fc(x))
        if self.training:
            return out, self.loss(out, target)
        return out


def test_training_model_keeps_its_mode_when_the_model_is_switched_to_eval():
    torch.manual_seed(0)
    model = _WithLoss()
    x, target = torch.randn(4, 6), torch.randn(4, 6)
    training = poptorch.trainingModel(model, poptorch.Options())
    model.eval()
    validation = poptorch.inferenceModel(model, poptorch.Options())
    out, loss = training(x, target)             # traced in training mode: a loss
    assert loss.dim() == 0 and not model.training
    prediction = validation(x)                  # traced in eval mode: no loss
    assert torch.equal(prediction, model(x))    # the trained weights, read back
    training.destroy()
    validation.destroy()


def test_the_submodules_follow_the_models_last_switch():
    """The layers are shared: after ``model.eval()`` the training model's
    dropout (p = 0.9) is off, as in PopTorch."""
    torch.manual_seed(0)
    model = _WithLoss(p=0.9)
    x, target = torch.randn(4, 6), torch.randn(4, 6)
    training = poptorch.trainingModel(model, poptorch.Options(),
                                      poptorch.optim.SGD(model.parameters(), lr=0.0))
    model.eval()
    out, _ = training(x, target)
    assert torch.allclose(out, model.fc(x), atol=1e-6)   # nothing dropped, none scaled
    assert not model.training
