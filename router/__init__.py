"""Request orchestration across deployments (encoder, prefill and decode routing)."""
