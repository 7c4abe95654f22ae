"""dspark.engines"""
