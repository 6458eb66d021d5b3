"""Ray Serve deployments: thin shells that own one engine per replica."""
