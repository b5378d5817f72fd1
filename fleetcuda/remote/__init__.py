"""What runs on targets: the framing protocol and the programs fleetcuda sends."""
