"""tierfs: a tiered-storage FUSE filesystem with HDFS-style storage policies.

The repository root is the ``tierfs`` package (see pyproject.toml ``package-dir``), so code
imports ``tierfs.fs.namespace``, never a bare ``fs``.
"""
