"""The build pipeline: plan, partition, quantize-gate-package orchestration, the drafter build, manifest records."""
