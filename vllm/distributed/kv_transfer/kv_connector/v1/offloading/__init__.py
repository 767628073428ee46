"""The offloading connector: moves KV blocks between the GPU and an ``OffloadingManager``'s tiers.

Modules: ``common`` (metadata exchanged between the halves), ``scheduler`` (scheduler side,
drives the manager), ``worker`` (worker side, drives the transfer handlers) and
``offloading_connector`` (the facade with vLLM's KV connector v1 method names).
"""
