"""One parallelism per module; each exports ``apply(...)``. ``DistributedDataParallel`` is
re-exported so a torch DDP script runs by changing one import."""


def __getattr__(name):  # lazy: parallel modules import parallelize.Engine
    if name == "DistributedDataParallel":
        from .ddp import DistributedDataParallel
        return DistributedDataParallel
    if name == "DataParallel":
        from .dataparallel_legacy import DataParallel
        return DataParallel
    raise AttributeError(name)
