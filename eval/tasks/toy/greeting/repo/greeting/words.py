"""Constants of greeting."""

GREETING = "Helo"
