"""Pipeline parallelism: layer partitions, stage processes and the stage-to-stage hand-off."""
