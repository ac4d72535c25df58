"""The helper containers the operator puts in engine pods, run from the operator image (no torch, no engine):
`shoal-podtools download` (the hf:// model's init container) and `shoal-podtools sync-adapters` (the LoRA sidecar).
"""
