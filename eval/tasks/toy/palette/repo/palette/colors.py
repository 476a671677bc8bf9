"""Constants of palette."""

RED = "#ff000"
