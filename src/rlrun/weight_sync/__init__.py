"""Weight sync: the actor's weights to the engines after each update. The sender's chunk order and staging buffers
(buckets) and the sync itself with its parameter sources, LoRA-merged ones included (sync). It reads the actor
through the strategies' full-parameter view (rlrun.strategies.blocks) and hands the engines what their receivers
take (rlrun.engines.receivers), so it sits above both.

May import strategies/ (blocks), engines/ (protocol, receivers), launch/ (the transfer and its bounded waits),
models/ and runtime/.
"""
