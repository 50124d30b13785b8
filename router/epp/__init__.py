"""The endpoint picker: kvrouter's decisions for a Gateway API Inference Extension gateway.

A gateway (Envoy, Istio, kgateway, …) asks over Envoy's ext_proc gRPC protocol which engine
should serve each request and proxies the bytes itself; the picker is a second front end
over the router's decision core (:mod:`router.decide`), beside the HTTP proxy
(:mod:`router.http`).
"""
