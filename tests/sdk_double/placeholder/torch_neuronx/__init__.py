# TEST DOUBLE: reproduces the PyPI placeholder package `torch-neuronx==1.0`, whose whole __init__.py is this raise.
raise ImportError("WRONG PACKAGE. Please install the package from Neuron Repository - pip.repos.neuron.amazonaws.com")
