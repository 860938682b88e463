"""Decentralized training: gossip over peer graphs and periodic model averaging (local SGD).

`graphs` is pure (topologies, mixing matrices); `replica` is the half both strategies share
(local step, the average model); `strategy` is gossip, `localsgd` periodic averaging;
`family` registers them with the trainer. See docs/decentralized.md.
"""
