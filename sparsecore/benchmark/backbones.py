"""The SECOND-style backbone the runtime and int8 benchmarks time (one definition for both)."""

from __future__ import annotations

from typing import Any

__all__ = ["second_backbone"]


def second_backbone(in_channels: int) -> Any:
    """A SECOND-style ``sparsecore.torch`` backbone in eval mode (seeded weights and BatchNorm statistics)."""
    import torch
    from torch import nn

    import sparsecore.torch as spconv

    def stage(cin: int, cout: int, layer: Any, **kwargs: Any) -> list:
        return [layer(cin, cout, bias=False, **kwargs), nn.BatchNorm1d(cout, eps=1e-3, momentum=0.01), nn.ReLU()]

    class Second(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            subm, conv = spconv.SubMConv3d, spconv.SparseConv3d
            self.net = spconv.SparseSequential(
                *stage(in_channels, 16, subm, kernel_size=3, indice_key="subm1"),
                *stage(16, 16, subm, kernel_size=3, indice_key="subm1"),
                *stage(16, 32, conv, kernel_size=3, stride=2, padding=1, indice_key="spconv2"),
                *stage(32, 32, subm, kernel_size=3, indice_key="subm2"),
                *stage(32, 64, conv, kernel_size=3, stride=2, padding=1, indice_key="spconv3"),
                *stage(64, 64, subm, kernel_size=3, indice_key="subm3"),
                *stage(64, 64, conv, kernel_size=3, stride=2, padding=(0, 1, 1), indice_key="spconv4"),
                *stage(64, 64, conv, kernel_size=(3, 1, 1), stride=(2, 1, 1), indice_key="spconv_down2"),
            )

        def forward(self, x: Any) -> Any:
            dense = self.net(x).dense()
            batch, channels, depth, height, width = dense.shape
            return dense.view(batch, channels * depth, height, width)

    torch.manual_seed(0)
    model = Second()
    generator = torch.Generator().manual_seed(0)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm1d):
            size = module.num_features
            module.running_mean.copy_((torch.rand(size, generator=generator) - 0.5) * 0.2)
            module.running_var.copy_(torch.rand(size, generator=generator) + 0.5)
    return model.eval()
