"""The fleet half's one way to talk to Kubernetes (no torch, no kubernetes-library calls but its kubeconfig loader):

* client: `KubeAPI` (where the API server is and how to authenticate) and `Client`, the async aiohttp client with
  get / list / create / server-side apply / merge patch / delete, used by the operator's reconciler and autoscaler
  and by the gateway (discovery, wake-ups);
* informer: `Informer`, one list-then-watch cache with optional indexes (the autoscaler's caches, the gateway's
  EndpointSlices and InferenceServices);
* events: `post_event`, how every part of the operator posts a Kubernetes Event.

kopf stays the reconcile loop: its own watches and indexes are kopf's business, but our code has one client.
"""
