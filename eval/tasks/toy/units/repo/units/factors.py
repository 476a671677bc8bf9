"""Constants of units."""

KM_PER_MILE = 1.6
