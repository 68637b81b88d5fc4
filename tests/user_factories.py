"""A user's own model, data, loss and metric, as `normlab compare` takes them by name (``user_factories:small_cnn``):
importable from the tests' directory, so that worker processes and ``torchrun`` processes rebuild them. Also the
bad factories the commands must refuse in one line."""

from __future__ import annotations

import torch
from torch import nn

STEPS = {"n": 0}  # scripted_loss's step counter (reset by the tests)


def digits16(num_train: int = 1400):
    """sklearn's 8x8 digits upsampled to 16x16 (1 channel): the training and test TensorDatasets."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).div(16).unsqueeze(1)
    x = nn.functional.interpolate(x, size=16)
    y = torch.tensor(d.target)
    ds = torch.utils.data.TensorDataset
    return ds(x[:num_train], y[:num_train]), ds(x[num_train:], y[num_train:])


def digits16_loaders():
    """The same data as DataLoaders of a plain map-style dataset (normlab keeps the datasets and the collate)."""

    class Pairs(torch.utils.data.Dataset):
        def __init__(self, tensors):
            self.x, self.y = tensors.tensors

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):
            return self.x[i], int(self.y[i])

    train, test = digits16()
    loader = torch.utils.data.DataLoader
    return {"train": loader(Pairs(train), batch_size=7), "test": loader(Pairs(test)), "num_classes": 10}


def small_cnn(num_classes: int, in_channels: int, norm_layer=nn.BatchNorm2d) -> nn.Module:
    """A small CNN that takes ``norm_layer`` (built with the comparison's norm, as torchvision's ResNet is)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, 8, 3, padding=1, bias=False),
        norm_layer(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1, stride=2, bias=False),
        norm_layer(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, num_classes),
    )


def bn_cnn(num_classes: int, **kwargs) -> nn.Module:
    """A small CNN with BatchNorm layers and no ``norm_layer``: normlab converts them (convert_norm)."""
    return small_cnn(num_classes, 1)


def no_norm_cnn(num_classes: int) -> nn.Module:
    """A CNN without a BatchNorm: nothing for convert_norm to replace."""
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, num_classes)
    )


def not_a_model(num_classes: int):
    """Returns something that is not an nn.Module."""
    return "a model"


def three_classes(in_channels: int) -> nn.Module:
    """Ignores num_classes: outputs 3 values per sample."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * 16 * 16, 3), nn.BatchNorm1d(3))


def raises(num_classes: int):
    raise RuntimeError("the factory broke")


def one_tensor():
    """Data that is not (input, target) pairs."""
    t = torch.utils.data.TensorDataset(torch.zeros(10, 1, 16, 16))
    return t, t


def scripted_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A training loss that is 2 for 10 steps, 0.5 for 10 steps, then 3 (an evaluation, without gradient, reads
    0.5): the net learns, then its loss climbs back past where it started, whatever the model does."""
    if not torch.is_grad_enabled():
        return output.sum() * 0 + 0.5
    i = STEPS["n"]
    STEPS["n"] += 1
    return output.sum() * 0 + (2.0 if i < 10 else 0.5 if i < 20 else 3.0)


def top2(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Top-2 accuracy: a user's metric (the batch's mean)."""
    return (output.topk(2, dim=1).indices == target[:, None]).any(1).float().mean()
