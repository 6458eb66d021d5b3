"""The OpenAI-compatible ingress: HTTP in, text out; the engines sit behind DeploymentHandles."""
