"""Writing datasets: samples in, zarr arrays and one ``dataset.json`` out. Imports flow down
this list only:

    samples.py         each sample checked against its fields' specs; rows per block
    array_writer.py    one zarr array: rows in, whole shard objects out (background puts)
    dataset_writer.py  DatasetWriter: one stream of samples -> a dataset (or one partition)
    partitions.py      write_partition, commit_dataset, gc_partitions (any engine, any order)
    forked.py          work in forked processes, results back as JSON over pipes
    parallel.py        write_dataset(workers=N): partitions by threads or forked processes
    by_file.py         `ckpt-data convert`: a source converted file by file in processes
    api.py             write_dataset: any input (sources, Hugging Face, iterables) -> a dataset
    ray_datasink.py    RayDatasink, a ray.data Datasink over partitions (imports ray; not
                       imported here)

Depends on `format` and `sources`; never on `read`, `order` or `loading`.
"""

from __future__ import annotations

from .api import write_dataset
from .dataset_writer import DatasetWriter
from .partitions import commit_dataset, gc_partitions, write_partition

__all__ = ["DatasetWriter", "commit_dataset", "gc_partitions", "write_dataset", "write_partition"]
