"""The device mesh: rank kinds, what tensor, context, pipeline and expert parallelism change in what a rank
holds, keeps and sends (docs/engines/mesh.md)."""
