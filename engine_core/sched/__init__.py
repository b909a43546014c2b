"""Requests, their queues and the continuous-batching scheduler."""
