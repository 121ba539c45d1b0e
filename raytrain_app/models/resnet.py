"""torchvision's ResNets: ResNet-18 with the usual CIFAR stem, for small images, and ResNet-50 as
it is, for ImageNet-sized ones (`data: images` at 224x224).

ImageNet's 7x7 stride-2 convolution and max-pool shrink a 32x32 image to 8x8 before the first
block; a 3x3 stride-1 stem keeps the resolution small images need.
"""

from torch import nn


def resnet18(input_shape: tuple = (3, 32, 32), num_classes: int = 10) -> nn.Module:
    from torchvision.models import resnet18 as tv_resnet18

    model = tv_resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(input_shape[0], 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def resnet50(input_shape: tuple = (3, 224, 224), num_classes: int = 1000) -> nn.Module:
    from torchvision.models import resnet50 as tv_resnet50

    model = tv_resnet50(num_classes=num_classes)
    if input_shape[0] != 3:
        model.conv1 = nn.Conv2d(input_shape[0], 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model
