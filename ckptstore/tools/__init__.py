"""Built on repositories: copying checkpoints between stores, inspection (show, diff, du),
import/export of other formats, and the lazy zarr view."""
