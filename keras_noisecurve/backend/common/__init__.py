"""The backend-neutral helpers both backend packages share, in numpy and ``keras.ops``: the
Philox counter generator (``philox``), the clipping factor and count (``clip``), privacy units
of several rows (``units``), the norm forms of the ghost kernels (``norm_forms``), the table of
layer rules (``layer_rules``, ``layer_classes``), the geometry of a layer's call (``geometry``),
recorded calls (``calls``), the checks of a model (``model_checks``, ``batch_probe``), the
affine scale of RMS-type norms (``affine_scale``), class weights (``class_weight``), the layer
norm observer (``norm_observer``), a run's batch (``run_batch``) and messages (``messages``);
and ``defaults``, the seam modules a backend package may leave out. Nothing here imports
TensorFlow or JAX at module level."""
