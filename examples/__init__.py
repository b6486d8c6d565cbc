"""Training examples for gradsparse: one shared driver (driver.py) and one module per task."""
