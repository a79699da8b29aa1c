"""Offline measurements through the serving path: accuracy of KV formats and sparse attention
(`hetserve eval`) and Oaken calibration (`hetserve calibrate`)."""
