"""Offline accuracy measurements of KV formats and sparse attention through the serving path, and Oaken calibration: `hetserve eval` and `hetserve calibrate`."""
