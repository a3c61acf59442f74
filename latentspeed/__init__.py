"""latentspeed's command-line front end (``latentspeed info``, ``latentspeed demo``).

The kernels live in ``common_kernels`` and the engine adapters in ``vllm_plugin``; this
package only reports on them and drives them.
"""
