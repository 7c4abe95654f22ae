"""dspark.runtime"""
