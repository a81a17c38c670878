"""The KV-cache manager and the workspace it places K/V into."""
