"""The cost model of a step that the scheduler lab and the autopilot share: a step's shape, a
measured cost profile (and how it is measured on a live engine), and the roofline floors a machine
puts under a step."""
