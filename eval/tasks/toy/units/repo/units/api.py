from units.factors import KM_PER_MILE


def miles_to_km(miles: float) -> float:
    return miles * KM_PER_MILE
