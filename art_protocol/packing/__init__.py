"""The numpy-only half of prefix-tree packing: trajectory checks (`inputs`), the prefix tree
(`prefix_tree`) and row placement (`placement`). The trainer's packer
(`art_megatron_ext.packing`, torch) builds tensors from these plans; the autotuner
(`art_protocol.autotune`, no torch) uses them to estimate how many groups fit a row budget."""
